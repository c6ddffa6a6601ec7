"""A whole deployed study on 127.0.0.1: aggregators and site agents as real processes.

Used by the tests, the benchmark and the demo. `LocalCluster` writes each
site's data file, a loopback study file and fresh keys into a folder, then
starts every aggregator (``secagg-roc aggregator``) and every site agent
(``secagg-roc site``) as a subprocess of this Python, with real TLS and real
SQLite files. `study()` returns the analyst's `RemoteStudy`. Each process logs
to ``logs/<party>.log`` in the folder. Only processes this object started are
ever signalled, by their process id.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from ..errors import ConfigError
from ..policy import Policy
from .config_schema import StudyConfig
from .config_write import loopback_study, study_to_dict, write_study
from .http import AggregatorClient
from .http_protocol import TransportError
from .pki import create_study_keys
from .remote_study import RemoteStudy
from .tls import client_ssl_context

__all__ = ["LocalCluster", "write_site_csv", "write_site_npz"]

READY_SITE = "following"


def _column_names(arrays: Mapping[str, np.ndarray]) -> dict[str, str | tuple[str, ...]]:
    cols: dict[str, str | tuple[str, ...]] = {}
    for name, a in arrays.items():
        a = np.asarray(a)
        if a.ndim == 1:
            cols[name] = name
        elif a.ndim == 2:
            cols[name] = tuple(f"{name}_{i}" for i in range(a.shape[1]))
        else:
            raise ConfigError(f"array {name!r} has {a.ndim} dimensions; a CSV holds 1-D or 2-D arrays")
    return cols


def _cell(x: Any, integer: bool) -> str:
    # repr() of a Python float is the shortest text that reads back as the same double.
    return str(int(x)) if integer else repr(float(x))


def write_site_csv(path: str | os.PathLike[str], arrays: Mapping[str, np.ndarray]) -> dict[str, str | tuple[str, ...]]:
    """Write a site's arrays as a CSV file that `load_site_data` reads back bit for bit.

    Integer arrays are written as integer literals (read back as int64),
    floats with ``repr`` (read back as the same float64; a float array is
    always written with a decimal point so it stays float). Returns the
    column mapping for the study file.
    """
    cols = _column_names(arrays)
    arrays = {k: np.asarray(v) for k, v in arrays.items()}
    n = {a.shape[0] for a in arrays.values()}
    if len(n) != 1:
        raise ConfigError(f"arrays have different numbers of records: {sorted(n)}")
    header: list[str] = []
    columns: list[tuple[np.ndarray, bool]] = []
    for name, a in arrays.items():
        integer = a.dtype.kind in "iub"
        if a.ndim == 1:
            header.append(name)
            columns.append((a, integer))
        else:
            header += list(cols[name])
            columns += [(a[:, i], False) for i in range(a.shape[1])]  # matrices are read as float
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as fh:
        fh.write(",".join(header) + "\n")
        lists = [(c.tolist(), integer) for c, integer in columns]
        for i in range(n.pop()):
            fh.write(",".join(_cell(col[i], integer) for col, integer in lists) + "\n")
    return cols


def write_site_npz(path: str | os.PathLike[str], arrays: Mapping[str, np.ndarray]) -> dict[str, str]:
    """Write a site's arrays as an ``.npz`` file (for large vectors); returns the column mapping."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **{k: np.asarray(v) for k, v in arrays.items()})
    return {k: k for k in arrays}


class LocalCluster:
    """Aggregators and site agents of one study as subprocesses on 127.0.0.1.

    `data` maps site name -> {array name -> array}; every site must have the
    same array names. `policy` is the sites' privacy policy, written into the
    study file's ``[policy]`` (a `Policy`, or its dict form `Policy.to_dict`,
    which may leave q and min_sites to `settings`; the policy's q and
    min_sites become the ``[study]`` keys). `settings` are further
    ``[study]`` keys (``privacy_level``, ``min_sites``, ``round_timeout_s``,
    ...). `seed` seeds the site agents' DP noise (``--seed``).
    `allowed_queries` maps a site to its query whitelist; `allow_non_private`
    starts every site agent with ``--allow-non-private`` (the operators'
    consent to the non-private mode, which the policy must allow as well).
    Use as a context manager: everything started is stopped on exit.
    """

    def __init__(
        self,
        folder: str | os.PathLike[str],
        data: Mapping[str, Mapping[str, np.ndarray]],
        *,
        n_aggregators: int = 2,
        seed: int | None = None,
        policy: Policy | Mapping[str, Any] | None = None,
        allowed_queries: Mapping[str, Sequence[str]] | None = None,
        allow_non_private: bool = False,
        data_format: str = "csv",
        study_id: str = "loopback",
        synchronous: str = "FULL",
        log_level: str = "INFO",
        **settings: Any,
    ):
        self.folder = Path(os.path.abspath(folder))
        self.data = data
        self.n_aggregators = n_aggregators
        self.seed = seed
        self.allowed_queries = dict(allowed_queries or {})
        self.allow_non_private = allow_non_private
        self.data_format = data_format
        self.study_id = study_id
        self.synchronous = synchronous
        self.log_level = log_level
        if policy is not None and not isinstance(policy, Policy):
            # The dict form may leave q and min_sites to the [study] settings.
            given = {k: settings[k] for k in ("privacy_level", "min_sites") if settings.get(k) is not None}
            policy = Policy.from_dict({**given, **policy})
        self.policy = policy
        self.settings = settings
        self.config: StudyConfig | None = None
        self.procs: dict[str, subprocess.Popen] = {}
        self._logs: dict[str, Any] = {}

    # -- setup -------------------------------------------------------------------

    def prepare(self) -> StudyConfig:
        """Write data files, the study file and keys (no process is started)."""
        sites = list(self.data)
        files, columns = {}, None
        for s in sites:
            if self.data_format == "npz":
                path = self.folder / "data" / f"{s}.npz"
                cols = write_site_npz(path, self.data[s])
            else:
                path = self.folder / "data" / f"{s}.csv"
                cols = write_site_csv(path, self.data[s])
            if columns is not None and cols != columns:
                raise ConfigError(f"site {s!r} has arrays {sorted(cols)}, others have {sorted(columns)}")
            columns, files[s] = cols, path
        config = loopback_study(self.folder, sites, self.n_aggregators, data_files=files, columns=columns,
                                study_id=self.study_id, policy=self.policy, **self.settings)
        if self.allowed_queries:
            raw = study_to_dict(config, self.folder)
            for site in raw["sites"]:
                if site["name"] in self.allowed_queries:
                    site["allowed_queries"] = list(self.allowed_queries[site["name"]])
            config = write_study(raw, self.folder / "study.toml")
        create_study_keys(config)
        self.config = config
        return config

    def start(self, *, sites: Sequence[str] | None = None, timeout: float = 60.0) -> "LocalCluster":
        """Prepare (once), start every aggregator and wait until each answers; then start `sites` (default all)."""
        if self.config is None:
            self.prepare()
        assert self.config is not None
        for a in self.config.aggregators:
            self.start_party(a.name, wait=False)
        for a in self.config.aggregators:
            self.wait_aggregator(a.name, timeout)
        for s in (self.site_names if sites is None else sites):
            self.start_party(s, wait=False)
        for s in (self.site_names if sites is None else sites):
            self.wait_site(s, timeout)
        return self

    @property
    def study_file(self) -> Path:
        return self.folder / "study.toml"

    @property
    def site_names(self) -> list[str]:
        return list(self.data)

    @property
    def aggregator_names(self) -> list[str]:
        assert self.config is not None
        return [a.name for a in self.config.aggregators]

    def study(self, **kwargs: Any) -> RemoteStudy:
        """The analyst's client of this cluster (close it when done)."""
        assert self.config is not None, "start() the cluster first"
        return RemoteStudy(self.config, **kwargs)

    # -- processes -----------------------------------------------------------------

    def command(self, name: str, extra: tuple[str, ...] = ()) -> list[str]:
        """The command line that runs party `name`."""
        assert self.config is not None
        role = self.config.party(name).role
        cmd = [sys.executable, "-m", "secagg_roc.cli"]
        # --stop-on-eof: each child's stdin is a pipe from this process, so if this process dies
        # (even by SIGKILL) the pipe closes and no aggregator or site agent is left behind.
        common = ["--study", str(self.study_file), "--name", name, "--sync", self.synchronous.lower(),
                  "--log-level", self.log_level, "--stop-on-eof"]
        if role == "aggregator":
            return cmd + ["aggregator", *common]
        if role == "site":
            cmd += ["site", *common]
            if self.seed is not None:
                cmd += ["--seed", str(self.seed)]
            if self.allow_non_private:
                cmd.append("--allow-non-private")
            return cmd + list(extra)
        raise ConfigError(f"{name!r} is the analyst: it runs in this process (study())")

    def start_party(self, name: str, *, wait: bool = True, timeout: float = 60.0, extra: tuple[str, ...] = ()) -> None:
        """Start the process of aggregator or site `name` (again, after `kill`); `extra`: more site flags."""
        if name in self.procs and self.procs[name].poll() is None:
            raise RuntimeError(f"{name} is already running (pid {self.procs[name].pid})")
        logs = self.folder / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        logfile = open(logs / f"{name}.log", "ab")
        logfile.write(f"--- starting {name} at {time.strftime('%H:%M:%S')}\n".encode())
        logfile.flush()
        self._logs[name] = logfile
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.procs[name] = subprocess.Popen(self.command(name, extra), stdin=subprocess.PIPE, stdout=logfile,
                                            stderr=subprocess.STDOUT, env=env, cwd=self.folder, start_new_session=True)
        if wait:
            assert self.config is not None
            if self.config.party(name).role == "aggregator":
                self.wait_aggregator(name, timeout)
            else:
                self.wait_site(name, timeout)

    def log_text(self, name: str) -> str:
        path = self.folder / "logs" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def _check_alive(self, name: str) -> None:
        proc = self.procs[name]
        if proc.poll() is not None:
            tail = "\n".join(self.log_text(name).splitlines()[-20:])
            raise RuntimeError(f"{name} exited with status {proc.returncode}; its log ends:\n{tail}")

    def wait_aggregator(self, name: str, timeout: float = 60.0) -> dict[str, Any]:
        """Block until aggregator `name` answers /v1/info over mutual TLS (as the analyst)."""
        assert self.config is not None
        agg = next(a for a in self.config.aggregators if a.name == name)
        a = self.config.analyst
        ctx = client_ssl_context(self.config.ca_cert, a.cert, a.key)

        async def probe() -> dict[str, Any]:
            client = AggregatorClient(agg, self.config.study_id, ctx, connect_timeout=2.0)
            try:
                return await client.info()
            finally:
                await client.close()

        end = time.monotonic() + timeout
        while True:
            self._check_alive(name)
            try:
                return asyncio.run(probe())
            except TransportError:
                if time.monotonic() > end:
                    raise TimeoutError(f"aggregator {name} did not answer within {timeout} s") from None
                time.sleep(0.05)

    def wait_site(self, name: str, timeout: float = 60.0) -> None:
        """Block until site agent `name` has loaded its data, follows the feeds, and every aggregator
        has heard from it (on a loaded machine its first poll can come well after it says it is ready)."""
        end = time.monotonic() + timeout
        marker = f"--- starting {name}"
        while True:
            self._check_alive(name)
            text = self.log_text(name)
            if READY_SITE in text[text.rfind(marker):] and self._heard_everywhere(name):
                return
            if time.monotonic() > end:
                raise TimeoutError(f"site agent {name} did not start within {timeout} s")
            time.sleep(0.05)

    def _heard_everywhere(self, site: str) -> bool:
        """Whether every aggregator that answers reports site `site` connected (/v1/presence, as the analyst).

        An aggregator that is down (a test may have stopped it) does not count;
        called from inside an event loop, where it cannot block, it says yes.
        """
        from .site_presence import connected

        assert self.config is not None
        try:
            asyncio.get_running_loop()
            return True
        except RuntimeError:
            pass
        a = self.config.analyst
        ctx = client_ssl_context(self.config.ca_cert, a.cert, a.key)

        async def probe() -> bool:
            for agg in self.config.aggregators:
                client = AggregatorClient(agg, self.config.study_id, ctx, connect_timeout=2.0)
                try:
                    if not connected((await client.presence()).get(site)):
                        return False
                except (TransportError, OSError):
                    continue  # not running: nothing to wait for there
                finally:
                    await client.close()
            return True

        return asyncio.run(probe())

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal party `name`'s process (SIGKILL by default: no clean-up at all) and reap it."""
        proc = self.procs[name]
        proc.send_signal(sig)  # a no-op once the process was reaped: never signals a reused pid
        proc.wait(30)
        if proc.stdin is not None:
            proc.stdin.close()

    def stop_party(self, name: str, timeout: float = 10.0) -> None:
        """Stop party `name` cleanly (SIGTERM; SIGKILL if it does not exit)."""
        proc = self.procs.get(name)
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
        if proc.stdin is not None:
            proc.stdin.close()

    def stop(self) -> None:
        """Stop every process this cluster started."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)  # all at once, then wait for each
        for name in list(self.procs):
            self.stop_party(name)
        for fh in self._logs.values():
            fh.close()

    def __enter__(self) -> "LocalCluster":
        if not self.procs:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
