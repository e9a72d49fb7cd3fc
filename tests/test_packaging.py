"""The distribution as a user installs it: one import package, label maps inside, runs anywhere."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MAPPED = {"builder": "spar_bench/builder", "probes": "spar_bench/probes",
          "manifests": "spar_bench/manifests", "spar_bench": "spar_bench", "experiments": "spar_bench/experiments"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
         "-w", str(out), str(REPO)],
        capture_output=True, encoding="utf-8", errors="replace", timeout=600, cwd=out,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    (whl,) = out.glob("spar_bench-*.whl")
    return whl


def _expected_modules() -> set[str]:
    """Every module of the source folders, at the path the namespace maps it to."""
    found = set()
    for folder, target in MAPPED.items():
        for p in (REPO / folder).rglob("*.py"):
            found.add(f"{target}/{p.relative_to(REPO / folder).as_posix()}")
    return found


@pytest.mark.slow
def test_wheel_holds_one_import_package_and_every_label_map(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"spar_bench"}, tops
    labels = {f"spar_bench/manifests/labels/{p.name}" for p in (REPO / "manifests/labels").glob("*.json")}
    assert labels and labels <= names
    missing = _expected_modules() - names
    assert not missing, f"modules not packaged (list their package in setup.cfg): {sorted(missing)}"


def _venv_over_running_environment(venv: Path) -> Path:
    """A new venv that sees the dependencies of the environment running the tests.

    ``--system-site-packages`` would expose the *base* interpreter's site-packages, which in a
    venv or conda env is not where the dependencies are (a clean base Python has none of them).
    Instead the new venv gets a ``.pth`` naming the running environment's site-packages: its
    dependencies are importable, while its ``.pth`` files (the editable install of the checkout)
    are not processed, so ``spar_bench`` comes from the wheel installed into the new venv.
    """
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, encoding="utf-8", check=True, timeout=60).stdout.strip()
    running = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    Path(site, "_running_environment.pth").write_text("".join(f"{d}\n" for d in running), encoding="utf-8")
    return venv


@pytest.mark.slow
def test_wheel_install_builds_and_fits_outside_the_repo(wheel: Path, tmp_path: Path) -> None:
    venv = _venv_over_running_environment(tmp_path / "venv")
    py, bindir = venv / "bin" / "python", venv / "bin"
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(wheel)],
                       capture_output=True, encoding="utf-8", errors="replace", timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = f"{bindir}{os.pathsep}{env['PATH']}"

    def run(*cmd: str) -> str:
        p = subprocess.run(list(cmd), capture_output=True, encoding="utf-8", errors="replace", timeout=600, cwd=work, env=env)
        assert p.returncode == 0, f"{cmd}: {p.stderr[-2000:]}"
        return p.stdout

    where = run(str(py), "-c", "import spar_bench.builder.ontology as o; print(o.__file__)")
    assert str(venv) in where, where  # the installed copy, not the checkout
    assert "word" in run("spar-build", "sources")
    run("spar-build", "phantom", "--out", "ph", "--n", "4")
    run("spar-build", "--source", "phantom", "--root", "ph", "--out", "b", "--levels", "level3",
        "--samples-per-case", "1", "--no-hf")
    run("spar-probe", "cache", "--encoder", "dummy", "--data", "b", "--out", "c.h5")
    run("spar-probe", "fit", "--features", "c.h5", "--head", "mlp", "--probe", "level3.size",
        "--seeds", "0", "--max-epochs", "2", "--out", "runs")
    assert list((work / "runs").rglob("metrics.json"))


def _readme_commands() -> list[str]:
    """The one-line commands of README.md's quick start, in order (main job, tests)."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    quick = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = quick.split("```bash\n")[1:]
    return [b.split("\n```", 1)[0].strip() for b in blocks]


def test_ci_runs_the_readme_test_command_in_a_fresh_venv() -> None:
    main_job, tests = _readme_commands()
    assert tests.startswith("python3 -m venv .venv && . .venv/bin/activate && ")
    assert tests.endswith("python -m pytest") and main_job.endswith("spar-bench run experiments/demo.yaml")
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert tests in ci, "'.ci/run' must run README.md's test command as written"
    assert ci.index("rm -rf .venv") < ci.index(tests), "CI's venv must be new, not left over"


def _tracked_top_folders() -> set[str]:
    r = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, encoding="utf-8", timeout=60)
    if r.returncode != 0:
        pytest.skip("not a git checkout: the tracked folders are unknown")
    return {line.split("/", 1)[0] + "/" for line in r.stdout.splitlines() if "/" in line}


def test_readme_layout_lists_every_top_level_folder() -> None:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    layout = text.split("\n## Layout", 1)[1].split("\n## ", 1)[0]
    listed = {row.split("|")[1].strip().strip("`") for row in layout.splitlines() if row.startswith("| `")}
    missing = sorted(_tracked_top_folders() - listed)
    assert not missing, f"README.md's Layout table lacks these top-level folders: {missing}"
