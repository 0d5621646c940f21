"""The README's code runs as written, and CI runs the README's test command."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_opens_with_two_one_line_setup_commands_and_ci_runs_the_test_one():
    first_block = re.search(r"```bash\n(.*?)```", README, re.S).group(1).strip().splitlines()
    assert len(first_block) == 2
    assert "dobb-bench compare" in first_block[0]
    assert first_block[1] in (ROOT / ".ci" / "run").read_text()


def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    assert blocks
    namespace: dict = {}
    for code in blocks:
        exec(compile(code, "README.md", "exec"), namespace)
    model = namespace["model"]
    assert all(p.isfinite().all() for p in model.parameters())


def test_readme_use_with_shows_each_stack_in_a_python_block():
    section = README.split("## Use with", 1)[1].split("\n## ", 1)[0]
    blocks = "\n".join(re.findall(r"```python\n(.*?)```", section, re.S))
    for module in ("dobb.integrations.hf", "dobb.integrations.lightning", "dobb.integrations.torchtitan"):
        assert f"from {module} import" in blocks, module
