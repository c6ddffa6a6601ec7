"""Writing a study file: `write_study` (validated, atomic), and `loopback_study` for one machine.

Run by the coordinator who sets up a study (``LocalCluster``, the demo and the
tests use `loopback_study`). `tomllib` only reads; `dumps_study` writes with
tomli-w (the [deploy] extra, as everything that writes a study file is part of
a deployment); a study is validated with `config_read.parse_study` before it is
written, so a study file on disk is always loadable.
"""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..errors import ConfigError
from ..extras import MissingExtra
from ..policy import Policy
from .config_policy import POLICY_IN_STUDY, policy_table
from .config_read import parse_study
from .config_schema import STUDY_FILE_NAME, StudyConfig

__all__ = ["study_to_dict", "dumps_study", "write_study", "loopback_study"]


def _rel(path: Path, base: Path) -> str:
    """`path` relative to `base` if it lies inside it (the folder stays movable), else absolute."""
    try:
        return path.relative_to(base).as_posix()
    except ValueError:
        return str(path)


def study_to_dict(config: StudyConfig, base_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The TOML shape of `config`, with paths relative to `base_dir` where they lie inside it."""
    base = Path(os.path.abspath(base_dir))
    study = {
        "id": config.study_id,
        "ca_cert": _rel(config.ca_cert, base),
        "ca_key": _rel(config.ca_key, base),
        **({"ca_crl": _rel(config.ca_crl, base)} if config.ca_crl is not None else {}),
        "privacy_level": config.privacy_level,
        "min_sites": config.min_sites,
        "frac_bits": config.frac_bits,
        "round_timeout_s": float(config.round_timeout_s),
        "max_body_bytes": config.max_body_bytes,
        "max_open_rounds": config.max_open_rounds,
        **({"handshake_timeout_s": float(config.handshake_timeout_s)} if config.handshake_timeout_s != 5.0 else {}),
        **({"max_handshakes_per_address": config.max_handshakes_per_address}
           if config.max_handshakes_per_address != 32 else {}),
        **({"scheme": config.scheme} if config.scheme != "additive" else {}),
        **({"threshold": config.threshold} if config.threshold is not None else {}),
    }
    aggregators = [
        {"name": a.name, "host": a.host, "port": a.port, "cert": _rel(a.cert, base),
         "key": _rel(a.key, base), "database": _rel(a.database, base),
         **({"bind": a.bind} if a.bind is not None else {}),
         **({"bind_port": a.bind_port} if a.bind_port is not None else {})}
        for a in config.aggregators
    ]
    sites = []
    for s in config.sites:
        site: dict[str, Any] = {"name": s.name, "cert": _rel(s.cert, base), "key": _rel(s.key, base),
                                "data": _rel(s.data, base),
                                "columns": {k: (v if isinstance(v, str) else list(v))
                                            for k, v in s.columns.items()}}
        if s.allowed_queries is not None:
            site["allowed_queries"] = list(s.allowed_queries)
        sites.append(site)
    a = config.analyst
    analyst = {"name": a.name, "cert": _rel(a.cert, base), "key": _rel(a.key, base)}
    return {"study": study, "aggregators": aggregators, "sites": sites, "analyst": analyst,
            "policy": policy_table(config.policy)}



_HEADER = """\
# secagg-roc study definition. PUBLIC: every party gets the same copy.
# Secret files it points to: keys/<party>/key.pem (only that party), keys/_ca/key.pem
# (only the coordinator who issues certificates), each aggregator's database, each site's data.
"""


def dumps_study(config: StudyConfig, base_dir: str | os.PathLike[str]) -> str:
    """The study file text for `config`, paths relative to `base_dir` where they lie inside it (needs tomli-w)."""
    try:
        import tomli_w
    except ImportError:
        raise MissingExtra("writing a study file needs tomli-w, part of the [deploy] extra: "
                           "pip install 'secagg-roc[deploy]'") from None
    d = study_to_dict(config, base_dir)
    if not d["policy"]:
        del d["policy"]  # the default policy: no empty [policy] table
    return _HEADER + "\n" + tomli_w.dumps(d)


def write_study(config: StudyConfig | Mapping[str, Any], path: str | os.PathLike[str]) -> StudyConfig:
    """Validate `config` (a `StudyConfig` or its TOML-shaped dict) and write it to `path`.

    A dict's relative paths are taken relative to `path`'s folder. The file is
    replaced atomically. Returns the study as `load_study(path)` will read it.
    """
    path = Path(os.path.abspath(path))
    base = path.parent
    data = study_to_dict(config, base) if isinstance(config, StudyConfig) else config
    # Validate before writing: a study file on disk is always loadable.
    checked = parse_study(data, base, origin=str(path), source=path)
    text = dumps_study(checked, base)
    base.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=base, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as fh:
            fh.write(text)
        os.chmod(tmp, 0o644)  # public by design; mkstemp's 0600 would hide it from other accounts
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return checked


def _free_tcp_ports(n: int) -> list[int]:
    # Bind all first, then release, so the n ports differ. Another process may still
    # take one before the aggregator starts; pass explicit ports where that matters.
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def loopback_study(
    folder: str | os.PathLike[str],
    site_names: Sequence[str],
    n_aggregators: int = 2,
    ports: Sequence[int] | None = None,
    data_files: Mapping[str, str | os.PathLike[str]] | Sequence[str | os.PathLike[str]] | None = None,
    *,
    columns: Mapping[str, str | Sequence[str]] | None = None,
    study_id: str = "loopback",
    analyst: str = "analyst",
    allowed_queries: Sequence[str] | None = None,
    policy: Policy | Mapping[str, Any] | None = None,
    **settings: Any,
) -> StudyConfig:
    """Write `folder/study.toml` for a study whose processes all run on 127.0.0.1.

    Aggregators are named ``agg-1`` .. ``agg-N`` on `ports` (free ports are picked
    when omitted). `data_files` maps site name to CSV (or lists them in
    `site_names` order); by default ``data/<site>.csv``. `columns` is every site's
    column mapping (default ``{"y": "y", "score": "score"}``). `settings` are
    further ``[study]`` keys (``privacy_level``, ``min_sites``, ...). `policy` is
    the ``[policy]`` table (a `Policy`, whose q and min_sites then become the
    [study] keys, or the table as a dict). Keys are not made here: run
    `deploy.pki.create_study_keys` on the result.
    """
    folder = Path(os.path.abspath(folder))
    if ports is None:
        ports = _free_tcp_ports(n_aggregators)
    if len(ports) != n_aggregators:
        raise ConfigError(f"loopback_study: {n_aggregators} aggregators need {n_aggregators} "
                          f"ports, got {len(ports)}")
    if data_files is None:
        files: dict[str, Any] = {s: f"data/{s}.csv" for s in site_names}
    elif isinstance(data_files, Mapping):
        files = dict(data_files)
    else:
        if len(data_files) != len(site_names):
            raise ConfigError(f"loopback_study: {len(site_names)} sites but "
                              f"{len(data_files)} data files")
        files = dict(zip(site_names, data_files))
    missing = [s for s in site_names if s not in files]
    if missing:
        raise ConfigError(f"loopback_study: no data file for site(s) {', '.join(missing)}")
    cols = dict(columns) if columns is not None else {"y": "y", "score": "score"}
    cols = {k: (v if isinstance(v, str) else list(v)) for k, v in cols.items()}

    data: dict[str, Any] = {
        "study": {"id": study_id, **settings},
        "aggregators": [
            {"name": f"agg-{j + 1}", "host": "127.0.0.1", "port": int(port)}
            for j, port in enumerate(ports)
        ],
        "sites": [],
        "analyst": {"name": analyst},
    }
    for s in site_names:
        site: dict[str, Any] = {"name": s, "data": str(files[s]), "columns": cols}
        if allowed_queries is not None:
            site["allowed_queries"] = list(allowed_queries)
        data["sites"].append(site)
    if isinstance(policy, Policy):
        for key in POLICY_IN_STUDY:
            given = settings.get(key)
            if given is not None and given != getattr(policy, key):
                raise ConfigError(f"loopback_study: {key} = {given!r} differs from the policy's {getattr(policy, key)!r}")
            data["study"][key] = getattr(policy, key)
        data["policy"] = policy_table(policy)
    elif policy is not None:
        data["policy"] = dict(policy)
    return write_study(data, folder / STUDY_FILE_NAME)
