"""The README's quick start runs as written and prints what it says."""

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_quick_start_runs(capsys):
    text = README.read_text()
    block = re.search(r"## Quick start\n+```python\n(.*?)```", text, re.S).group(1)
    namespace: dict = {}
    exec(compile(block, "README quick start", "exec"), namespace)
    out = capsys.readouterr().out
    assert "Binormal form: pnorm(" in out and "AUC and 0.95 CI" in out
    assert abs(namespace["r"].auc - 0.73) < 0.05
    lo, auc, hi = namespace["sr"].pooled.delong_ci(namespace["y"], namespace["s"])
    assert (round(lo, 4), round(auc, 4), round(hi, 4)) == (0.6301, 0.7314, 0.8326)
    assert namespace["total"].tolist() == [4.5, 1.5]
    assert "Sites: h0, h1, h2" in out and "1 DP release(s)" in out


def test_deployment_study_file_is_valid(tmp_path):
    import tomllib

    from secagg_roc.deploy.config import parse_study

    text = README.read_text()
    block = re.search(r"\*\*1\. The coordinator writes `study.toml`\*\*.*?```toml\n(.*?)```", text, re.S).group(1)
    more = '[[sites]]\nname = "hospital-b"\ndata = "b.csv"\ncolumns = { y = "o", score = "p" }\n'
    study = parse_study(tomllib.loads(block.replace("# ... hospital-b to hospital-e", more)), tmp_path, origin="README")
    policy = study.policy
    assert policy.dp.epsilon == 0.3 and policy.roles["label"] == ("y",) and policy.privacy_level == 5
