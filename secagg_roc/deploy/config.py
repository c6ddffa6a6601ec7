"""The study file: one TOML document that every party of a deployed study shares.

A study file names the study, its privacy settings and every party: the
aggregators (where they listen), the sites (where their data is and which site
queries they accept) and the analyst. It is read with the standard library's
`tomllib` into frozen dataclasses, validated as a whole, and is *public*: every
party gets the same copy. Relative paths are resolved against the folder that
holds the study file, so a study folder can be moved as a unit.

Who keeps which file secret (the layout `create_study_keys` and
`loopback_study` use)::

    study.toml                 public   every party has the same copy
    ca.pem                     public   the study CA certificate (trust anchor), every party
    keys/<party>/cert.pem      public   <party>'s certificate, shown to peers in the TLS handshake
    keys/<party>/key.pem       SECRET   <party>'s private key; only <party> may have it
    keys/_ca/key.pem           SECRET   the study CA's key; only the coordinator who issues
                                        certificates needs it, never at run time
    state/<aggregator>.sqlite  SECRET   an aggregator's shares; only that aggregator
    data/<site>.csv            SECRET   a site's records; never leave the site

Party names start with a letter or digit, so no party can be called ``_ca``.
The operators' guide to this file, with an example that runs as written, is
``docs/study-file.md``; the example below shows every key.

Example (every key of the schema; the ones marked optional show their default)::

    [study]
    id = "gbsg2-validation"         # [A-Za-z0-9][A-Za-z0-9_.-]{0,63}, bound into certificates
    ca_cert = "ca.pem"              # optional
    ca_key = "keys/_ca/key.pem"     # optional; read only by `secagg-roc keys`
    ca_crl = "crl.pem"              # optional: revoked certificates (`secagg-roc keys revoke`)
    privacy_level = 5               # optional: q, the fewest records a release may cover
    min_sites = 2                   # optional: the fewest sites a release may cover (>= 2)
    frac_bits = 32                  # optional: fixed-point fraction bits in Z_2^64
    round_timeout_s = 300.0         # optional: how long a round waits for its sites (abandoned after twice this)
    max_body_bytes = 67108864       # optional: largest request an aggregator accepts
    max_open_rounds = 16            # optional: rounds an aggregator keeps open at once
    handshake_timeout_s = 5.0       # optional: an unfinished TLS handshake is dropped after this
    max_handshakes_per_address = 32 # optional: unfinished TLS handshakes from one address at once
    scheme = "additive"             # optional: or "shamir", "replicated", "pairwise"
    # threshold = 2                 # optional, with "shamir" or "pairwise" only (default: a majority)

    [[aggregators]]
    name = "agg-1"
    host = "127.0.0.1"              # the host name or IP address the others connect to
    port = 8441
    bind = "127.0.0.1"              # optional (default: host): the address it listens on (NAT: "0.0.0.0")
    bind_port = 8441                # optional (default: port): the port it listens on
    cert = "keys/agg-1/cert.pem"    # optional
    key = "keys/agg-1/key.pem"      # optional
    database = "state/agg-1.sqlite" # optional

    [[aggregators]]
    name = "agg-2"
    host = "127.0.0.1"
    port = 8442

    [[sites]]
    name = "hospital-a"
    data = "data/hospital-a.csv"
    # array name used by site queries -> CSV column (a list makes a matrix, one column each)
    columns = { y = "cens", score = "pred", X = ["age", "tsize"] }
    # optional; omitted = every registered site query (see `secagg_roc.queries.QUERIES`)
    allowed_queries = ["calibration.brier", "calibration.bins"]

    [[sites]]
    name = "hospital-b"
    data = "data/hospital-b.csv"
    columns = { y = "cens", score = "pred" }

    [analyst]
    name = "analyst"

    # The sites' privacy policy (`secagg_roc.policy.Policy`): what the study may
    # release. Every site checks every request against it; q and min_sites are
    # the [study] keys above (they are part of the policy, and set only there).
    [policy]
    min_cell_count = 5              # optional (default: q): fewest records in a released table cell, a label class or a GLM group at a site
    allow_dropouts = false          # optional: may a run start without every site?
    allow_non_private = false       # optional: may the exact-score validation mode run at all?
    analyses = ["glm", "rocglm", "brier", "calibration"]   # optional (default: these, score_histogram, secure_auc)
    score_range = [0.0, 1.0]        # optional: public score range; scores outside it are clipped
    calibration_bins = 10          # optional: the calibration curve's fixed bins
    calibration_strategy = "uniform" # optional: or "quantile" (equal-count bins from the scores' DP release)
    rocglm_thresholds = 30          # optional: the ROC-GLM's fixed threshold grid
    rocglm_fit = "released"         # optional: a DP ROC-GLM fitted to the DP release alone, or "exact" (the paper's rounds)
    sensitivity_resolution = 0.0001 # optional: grid of the l2-sensitivity estimate
    histogram_bins = 1000           # optional: the score histograms' grid

    [policy.roles]                  # optional; omitted = any array in any role (one role per analysis)
    label = ["y"]
    score = ["score"]
    covariate = ["X"]

    [policy.dp]                     # optional; omitted = no differentially private release at all
    epsilon = 0.5                   # the most one DP release may cost (an analyst may ask for less)
    delta = 0.3
    l2_sensitivity = 0.05           # an analyst may ask for a larger one, never a smaller
    mechanism = "analytic"          # optional: "analytic" or "classic" (the paper's)
    budget_epsilon = 1.0            # optional (default: one release): all of one site's DP releases
    budget_delta = 0.5              # optional
    accounting = "gaussian"         # optional: "gaussian" (exact composition) or "basic" (sums)

Unknown keys are refused (a misspelt security setting must not be silently
ignored). Files are not required to exist when the study is loaded: the analyst
has no site's data, and keys are made after the study file is written.

The study file's parts, each its own module (this one gathers their public
names, so ``from secagg_roc.deploy.config import ...`` reaches all of them):

- `config_schema`: party names and the frozen dataclasses (`StudyConfig`, ...);
- `config_table`: typed reading of one TOML table (`TomlTable`);
- `config_policy`: the ``[policy]`` table, read and written;
- `config_read`: `parse_study` and `load_study`, which validate a whole study;
- `config_write`: `write_study`, `dumps_study`, `study_to_dict` and `loopback_study`.
"""

from __future__ import annotations

from .config_policy import policy_table
from .config_read import load_study, parse_study
from .config_schema import (
    DEFAULT_MAX_BODY_BYTES,
    NAME_PATTERN,
    ROLES,
    AggregatorConfig,
    AnalystConfig,
    ColumnMap,
    SiteConfig,
    StudyConfig,
    is_loopback_host,
    is_valid_name,
)
from .config_write import dumps_study, loopback_study, study_to_dict, write_study

# Importable from here too (callers may use them), though not in `__all__`.
from .config_schema import DEFAULT_CA_CERT, DEFAULT_CA_KEY, STUDY_FILE_NAME, Party  # noqa: F401

__all__ = [
    "ROLES",
    "NAME_PATTERN",
    "DEFAULT_MAX_BODY_BYTES",
    "ColumnMap",
    "AggregatorConfig",
    "SiteConfig",
    "AnalystConfig",
    "StudyConfig",
    "is_valid_name",
    "is_loopback_host",
    "load_study",
    "parse_study",
    "study_to_dict",
    "dumps_study",
    "write_study",
    "loopback_study",
    "policy_table",
]

