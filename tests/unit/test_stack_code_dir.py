"""StackSettings.code_dir: the stack's processes run from another source tree (the baseline
revision of `bench.stack_ab`), not from the installed code."""

import os
import textwrap

from specdec.launcher.stack import Stack, StackSettings

REPORT = textwrap.dedent(
    """
    import os
    print("READY", os.path.realpath(__file__), os.environ.get("SPECDEC_REDIS_URL"), flush=True)
    """
)


def _spawn_and_read(stack: Stack, module: str) -> tuple[int, str]:
    child = stack._spawn("probe", module, [])
    try:
        code = child.process.wait(timeout=60)
    finally:
        child.signal(9)
    child.ready.wait(timeout=5)
    return code, child.tail(50)


def test_children_run_the_modules_of_code_dir(tmp_path):
    tree = tmp_path / "baseline"
    for package in ("coordinator", "only_in_baseline"):
        (tree / package).mkdir(parents=True)
        (tree / package / "__init__.py").write_text("")
        (tree / package / "__main__.py").write_text(REPORT)
    settings = StackSettings("t", "d", redis_url="redis://x:1/0", code_dir=str(tree))
    # a module both trees have: the baseline's copy runs, not the installed one
    code, out = _spawn_and_read(Stack(settings), "coordinator")
    assert code == 0, out
    assert f"READY {os.path.realpath(tree / 'coordinator' / '__main__.py')}" in out
    assert "redis://x:1/0" in out  # the Redis URL still reaches it, in the environment
    code, out = _spawn_and_read(Stack(settings), "only_in_baseline")
    assert code == 0 and "READY" in out, out
    # negative control: without code_dir the baseline's module is not found
    settings.code_dir = ""
    code, out = _spawn_and_read(Stack(settings), "only_in_baseline")
    assert code != 0 and "No module named only_in_baseline" in out, out
