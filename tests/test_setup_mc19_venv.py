"""tools/setup_mc19_venv.sh after an interrupted setup: a ``.venv-mc19`` left half-made (no pip,
no working python) is made again instead of breaking every rerun ("pip: No such file"); a venv
whose python and pip run is kept.

The script runs from a copy in a temporary folder (it works in the folder above its own), with
pip offline (no index, no wheel folder): it gets as far as its first install, which fails at
once instead of downloading torch and megatron-core 0.19 for minutes. What is checked is the
venv it leaves.
"""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tools", "setup_mc19_venv.sh")

pytestmark = pytest.mark.skipif(shutil.which("python3") is None, reason="the script's python3")


def _copy(tmp_path):
    (tmp_path / "tools").mkdir()
    shutil.copy(SCRIPT, tmp_path / "tools")
    return tmp_path / ".venv-mc19"


def _run(tmp_path):
    # No index and no local wheel folder (from the environment or pip's config files).
    env = {k: v for k, v in os.environ.items()
           if k not in ("PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL")}
    env.update(PIP_NO_INDEX="1", PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1")
    return subprocess.run(["bash", str(tmp_path / "tools" / "setup_mc19_venv.sh")], env=env,
                          capture_output=True, text=True, timeout=300)


def _pip_runs(venv) -> bool:
    python = venv / "bin" / "python"
    return python.exists() and subprocess.run([str(python), "-m", "pip", "--version"],
                                              capture_output=True).returncode == 0


def _offline_install_failure(done):
    """The run got past the venv to its first install, which pip refused offline."""
    assert done.returncode not in (0, 3) and "torch" in done.stderr, done.stderr
    assert "No such file" not in done.stderr, done.stderr


@pytest.mark.parametrize("damage", ["no-pip", "no-python"])
def test_a_half_made_venv_is_made_again(tmp_path, damage):
    venv = _copy(tmp_path)
    if damage == "no-pip":  # interrupted before venv installed pip (it does that last)
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    else:  # interrupted right after the folder was made
        venv.mkdir()
        (venv / "pyvenv.cfg").write_text("home = /nowhere\n")
    assert not _pip_runs(venv)
    done = _run(tmp_path)
    _offline_install_failure(done)
    assert ".venv-mc19 is incomplete" in done.stderr and "making it again" in done.stderr
    assert _pip_runs(venv)  # repaired: the next run's installs can proceed
    # The rerun trusts the repaired venv.
    again = _run(tmp_path)
    _offline_install_failure(again)
    assert "incomplete" not in again.stderr, again.stderr


def test_a_venv_whose_pip_runs_is_kept(tmp_path):
    venv = _copy(tmp_path)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    (venv / "kept").write_text("")  # removed if the venv were made again
    done = _run(tmp_path)
    _offline_install_failure(done)
    assert "incomplete" not in done.stderr and (venv / "kept").exists(), done.stderr
