"""The ROC-GLM paper's simulation study at scale (Schalk et al., section 5).

`design` (data generation, the grid of epsilon x delta x l2-sensitivity, each
task's seeds), `runner` (run and resume into a JSON-lines file), `results`
(Table 1 and Figures 4-5 as Markdown, CSV and PNG), `dask_backend`
(scale-out on Dask, optional extra ``[dask]``). The command line:
``secagg-roc simulate`` (`simulation.cli`).

    from secagg_roc import simulation as sim
    sim.run("out/results.jsonl", sim.parse_settings("0-3"), 100, master_seed=sim.MASTER_SEED)
    sim.write_summary("out/results.jsonl")
"""

from __future__ import annotations

from .design import (
    AUC_BINS,
    DELTAS,
    EPSILONS,
    L2_SENSITIVITIES,
    MASTER_SEED,
    N_DATASETS,
    N_SITES,
    Setting,
    auc_bin,
    dataset,
    generate,
    paper_grid,
    parse_settings,
    split_rng,
    split_sites,
    task_rng,
)
from .results import bin_summary, table_markdown, write_summary
from .runner import ResultsFileError, design_header, read_results, run, run_task, run_tasks

__all__ = [
    "AUC_BINS", "DELTAS", "EPSILONS", "L2_SENSITIVITIES", "MASTER_SEED", "N_DATASETS", "N_SITES",
    "ResultsFileError", "Setting", "auc_bin", "bin_summary", "dataset", "design_header", "generate",
    "paper_grid", "parse_settings", "read_results", "run", "run_task", "run_tasks", "split_rng", "split_sites",
    "table_markdown", "task_rng", "write_summary",
]
