"""The repository's kernels/ never stands in for Hugging Face's `kernels`. With the repository root on sys.path
(`python -m pytest` or `python train.py` run there) `import kernels` found this directory first; transformers 5.25
installs Hugging Face's package and imports `from kernels import CUDAProperties` with every model, so a clean CI
checkout failed to collect every test that imports a transformers model."""
import os
import subprocess
import sys

from launch_env import launch_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def import_kernels(*path: str) -> str:
    """`import kernels` in a fresh interpreter whose sys.path starts with `path` -> what the module calls itself."""
    code = (f"import sys; sys.path[:0] = {list(path)!r}; import kernels; "
            f"print(getattr(kernels, 'WHOSE', 'ours' if kernels.__file__.startswith({REPO!r}) else kernels.__file__))")
    done = subprocess.run([sys.executable, "-c", code], env=launch_env("PYTHONPATH"), capture_output=True, text=True,
                          cwd=os.path.dirname(REPO), timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_repository_root_on_sys_path_hands_import_kernels_to_the_installed_package(tmp_path):
    site = tmp_path / "site"
    (site / "kernels" / "_internals").mkdir(parents=True)
    (site / "kernels" / "_internals" / "__init__.py").write_text("CUDAProperties = 'hf'\n")
    (site / "kernels" / "__init__.py").write_text("from kernels._internals import CUDAProperties\nWHOSE = 'hf'\n")
    assert import_kernels(REPO, str(site)) == "hf"  # its own submodules resolve too


def test_without_another_kernels_the_repository_one_stays_an_empty_package():
    assert import_kernels(REPO) == "ours"


def test_dflash_fast_kernels_is_still_the_repositorys_kernels():
    import dflash_fast.kernels

    assert os.path.dirname(dflash_fast.kernels.__file__) == os.path.join(REPO, "kernels")
