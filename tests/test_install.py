"""A non-editable install, as `pip install .` and the Docker image (infra/docker/Dockerfile) make
it: the wheel built from the checkout, installed into a folder of its own (`pip install
--target`) and run from outside the checkout. The test venv has an editable install of a
checkout, so each run first shows that `pipeline` and `schemas` are imported from that folder.

Docker cannot run here (its client is installed, but no daemon runs), so the image is never
built: its Dockerfile is read for what the demo needs (the kit and SPECBATCH_KIT_DIR), and the
demo runs from the installed wheel with SPECBATCH_KIT_DIR set as the image sets it: the README's
demo block, run as tests/test_readme.py runs the README. That demo starts an engine; nothing
else here does.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
KIT = ROOT / "models" / "tinykit"
DOCKERFILE = ROOT / "infra" / "docker" / "Dockerfile"
WEIGHTS = (".safetensors", ".bin", ".pt", ".gguf")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """`pip wheel --no-build-isolation`: the venv's setuptools, offline (build isolation would
    download one). The build writes build/ and *.egg-info into its source, so it runs on a copy
    of the checkout (models/ included, so that leaving the weights out is the wheel's doing)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(
        ROOT,
        src,
        ignore=shutil.ignore_patterns(".git", ".venv", "runs", "build", "*.egg-info", "__pycache__", ".pytest_cache"),
    )
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-cache-dir",
            "-q",
            "-w",
            str(tmp / "dist"),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    [built] = (tmp / "dist").glob("specbatch-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """The wheel installed into a folder of its own (its console script in bin/)."""
    site = tmp_path_factory.mktemp("site")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-cache-dir",
            "-q",
            "--target",
            str(site),
            str(wheel),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return site


def run_installed(site: Path, cwd: Path, *args: str, kit_dir: Path | None = None, timeout: float = 120):
    """The venv's python on `site` first, from `cwd` (outside the checkout)."""
    env = dict(os.environ, PYTHONPATH=str(site))
    env.pop("SPECBATCH_KIT_DIR", None)
    if kit_dir is not None:
        env["SPECBATCH_KIT_DIR"] = str(kit_dir)
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_wheel_holds_the_package_data_and_no_weights(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if n.endswith(WEIGHTS)], "model weights in the wheel"
    assert {n.split("/")[0] for n in names} == {
        "pipeline",
        "schemas",
        "tinykit",
        wheel.name.split("-py3")[0] + ".dist-info",
    }
    assert {"pipeline/tools/prices.yaml", "pipeline/tools/demo.yaml"} <= set(names)
    schemas = {f"schemas/json/{p.name}" for p in (ROOT / "schemas" / "json").glob("*.schema.json")}
    assert schemas and schemas <= set(names)
    assert wheel.stat().st_size < 1_000_000, wheel.stat().st_size


@pytest.mark.engine
def test_the_installed_wheel_runs_outside_the_checkout(installed, tmp_path):
    where = run_installed(
        installed, tmp_path, "-c", "import pipeline, schemas; print(pipeline.__file__); print(schemas.__file__)"
    )
    assert where.returncode == 0, where.stderr[-3000:]
    assert all(Path(p).is_relative_to(installed) for p in where.stdout.split()), where.stdout

    # The console script pip wrote, as a user runs it.
    help_text = run_installed(installed, tmp_path, str(installed / "bin" / "specbatch"), "--help")
    assert help_text.returncode == 0, help_text.stderr[-3000:]
    assert "demo" in help_text.stdout and "check-drafter" in help_text.stdout

    # The drafter checks on the kit the image ships.
    check = run_installed(
        installed,
        tmp_path,
        "-m",
        "pipeline.cli",
        "check-drafter",
        "--model",
        str(KIT / "target"),
        "--drafter",
        str(KIT / "drafter-eagle31"),
    )
    assert check.returncode == 0, check.stdout[-3000:] + check.stderr[-3000:]

    # Without a kit (no SPECBATCH_KIT_DIR, no checkout beside the package) the demo builds a
    # random-weight kit, and its config, from the package's demo.yaml, validates; the engine
    # run itself is the next test's, on the trained kit.
    fallback = run_installed(
        installed,
        tmp_path,
        "-c",
        """if True:
        import json
        from pathlib import Path
        import yaml
        from pipeline.config import load_config
        from pipeline.tools.demo import demo_config, demo_models
        root = Path("demo").resolve()
        models, trained = demo_models(root)
        path = root / "job.yaml"
        path.write_text(yaml.safe_dump(demo_config(root, models, trained)))
        config = load_config(str(path))
        print(json.dumps({"trained": trained, "target": config.model.path, "probe": config.speculative.probe.rows,
                          "guard": config.speculative.guard, "max_tokens": config.sampling.max_tokens}))
    """,
        timeout=300,
    )
    assert fallback.returncode == 0, fallback.stderr[-3000:]
    got = json.loads(fallback.stdout.splitlines()[-1])
    demo_settings = yaml.safe_load((ROOT / "pipeline" / "tools" / "demo.yaml").read_text())
    random_kit = (tmp_path / "demo" / "random-kit").resolve()
    assert got == {
        "trained": False,
        "target": str(random_kit / "target"),
        "probe": 0,
        "guard": None,
        "max_tokens": demo_settings["sampling"]["max_tokens"],
    }
    assert (random_kit / "drafter" / "config.json").is_file()


@pytest.mark.engine
def test_the_readmes_demo_runs_from_the_installed_wheel_with_the_kit_the_image_ships(installed, tmp_path):
    """The README's demo block, run as tests/test_readme.py runs the README (its shell, outside
    the checkout), by the installed package with the kit from SPECBATCH_KIT_DIR: what `docker run
    IMAGE specbatch demo` runs, less Docker. A new user's console is quiet: Ray's and vLLM's logs
    go to their log folder (its path is printed), engines shut down cleanly, and the summary is
    on stdout."""
    import jsonschema

    from tests.test_readme import readme_blocks, readme_env, run_block

    (block,) = [b for b in readme_blocks() if b.lang == "bash" and "specbatch demo" in b.body]
    rows = int(re.search(r"--rows (\d+)", block.body).group(1))
    env = readme_env()
    env.update(
        PATH=f"{installed / 'bin'}{os.pathsep}{env['PATH']}", PYTHONPATH=str(installed), SPECBATCH_KIT_DIR=str(KIT)
    )
    out = run_block(block, tmp_path, env)
    console = out.stdout + out.stderr
    assert f"specbatch demo: kit: the trained tiny kit in {KIT}" in out.stdout
    assert "specbatch demo: succeeded" in out.stdout, console[-4000:]
    assert "ERROR" not in console and "Warning" not in console, console[-4000:]  # no deprecation warning of ours either
    assert "Ray's and vLLM's logs:" in out.stderr and f"{rows}/{rows} rows" in out.stderr
    # each progress line's engine speed counts the engine time of the units it counts the tokens
    # of: no line runs ahead of the summary's (one once printed 1,086, 2,172, 3,258, then 2,094)
    engine_rates = [int(r.replace(",", "")) for r in re.findall(r"([\d,]+) tok/s engine", out.stderr)]
    summary_rate = int(re.search(r"([\d,]+) tok/s of engine time", out.stdout).group(1).replace(",", ""))
    assert engine_rates and max(engine_rates) <= 1.25 * summary_rate, (engine_rates, summary_rate)
    # every line is specbatch's: none of Ray's (its core worker's once-per-process line that
    # Ray Data's actors have constructor arguments in the object store included), vLLM's or Triton's
    foreign = [
        line
        for line in console.splitlines()
        if line.strip() and not line.startswith(("specbatch", "[specbatch]", "  "))
    ]
    assert not foreign, foreign

    (manifest_path,) = tmp_path.rglob("_job.json")
    manifest = json.loads(manifest_path.read_text())
    jsonschema.validate(manifest, json.loads((installed / "schemas" / "json" / "job_manifest.schema.json").read_text()))
    assert manifest["status"] == "succeeded" and manifest["totals"]["output_rows"] == rows
    assert manifest["model"]["path"] == str(KIT / "target")
    assert sum(pq.read_metadata(p).num_rows for p in (manifest_path.parent / "outputs").rglob("*.parquet")) == rows
    # too small for the speculation trial: it says why and starts one engine
    assert manifest["trial"]["outcome"] == "skipped" and manifest["trial"]["reason"] in out.stderr
    assert len(manifest["attempts"][0]["start"]["engine_starts"]) == 1
    # the engine stopped before its actor ended: its client found no EngineCore gone under it
    logs = Path(re.search(r"Ray's and vLLM's logs: (\S+)", out.stderr).group(1))
    worker_logs = {path.name: path.read_text(errors="replace") for path in logs.glob("worker-*")}
    assert any("MPClient: complete" in text for text in worker_logs.values()), sorted(worker_logs)
    for name, text in worker_logs.items():
        for sign in ("EngineDeadError", "engine core exited unexpectedly"):
            assert sign not in text, f"{logs / name}: {sign}"


def test_on_vllms_cuda_build_the_demo_asks_for_a_gpu(tmp_path, monkeypatch):
    """The image's default (vLLM's CUDA build, whose engine runs on a GPU only): the demo asks
    Ray for a GPU, so a host without one refuses it before any engine starts."""
    from pipeline.cluster import Unschedulable, check_schedulable
    from pipeline.config import parse_config
    from pipeline.tools import demo

    monkeypatch.setattr(demo, "vllm_cuda_build", lambda: True)
    config = parse_config(demo.demo_config(tmp_path, demo.trained_kit(), trained=True))
    assert (config.resources.gpus_per_replica, config.engine.dtype) == (1, "float16")
    with pytest.raises(Unschedulable, match="GPU: 1"):
        check_schedulable(config, [{"CPU": 4.0}], [])
    check_schedulable(config, [{"CPU": 4.0, "GPU": 1.0}], [])


def test_local_yaml_is_the_demo_settings_with_the_checkouts_paths():
    """One set of demo settings: the package's demo.yaml, and jobs/configs/local.yaml, the
    example config, which is demo.yaml with this checkout's paths."""
    from pipeline.config import load_config
    from tinykit import kit_paths

    local = yaml.safe_load((ROOT / "jobs" / "configs" / "local.yaml").read_text())
    paths = {
        "input_uri": local.pop("input_uri"),
        "output_uri": local.pop("output_uri"),
        "model": local.pop("model"),
        "drafter": local["speculative"].pop("drafter"),
    }
    assert local == yaml.safe_load((ROOT / "pipeline" / "tools" / "demo.yaml").read_text())
    assert set(paths["model"]) == {"path"}
    config = load_config(str(ROOT / "jobs" / "configs" / "local.yaml"))
    kit = kit_paths(str(KIT))
    assert (config.model.path, config.speculative.drafter) == (kit["target"], kit["drafter_eagle31"])


def test_the_dockerfile_ships_what_the_demo_needs():
    """Read, not built (no Docker daemon here): the image copies the kit, points
    SPECBATCH_KIT_DIR at it, and installs from what it copies."""
    lines = [ln.strip() for ln in DOCKERFILE.read_text().splitlines() if not ln.strip().startswith("#")]
    instructions = [ln for ln in "\n".join(lines).replace("\\\n", " ").splitlines() if ln]  # continuations joined
    [workdir] = [ln.split()[1] for ln in instructions if ln.startswith("WORKDIR ")]
    copies = {}
    for ln in instructions:
        if ln.startswith("COPY "):
            *sources, dest = [w for w in ln.split()[1:] if not w.startswith("--")]
            for source in sources:
                copies[source] = dest
    for source in copies:
        assert (ROOT / source).exists(), f"COPY {source}: not in the checkout"
    assert {"pyproject.toml", "README.md", "pipeline", "schemas", "tinykit", "jobs", "models/tinykit"} <= set(copies), (
        copies
    )
    kit_in_image = os.path.normpath(os.path.join(workdir, copies["models/tinykit"]))
    env = " ".join(ln for ln in instructions if ln.startswith("ENV "))
    assert re.search(rf"\bSPECBATCH_KIT_DIR={re.escape(kit_in_image)}/?(\s|$)", env), (kit_in_image, env)
    args = dict(a.split()[1].split("=", 1) for a in instructions if a.startswith("ARG ") and "=" in a)
    assert args.get("EXTRA") == "cuda", args  # the default image is the CUDA build; EXTRA=cpu runs anywhere
    assert any(re.search(r'pip install .*"\.\[\$\{?EXTRA\}?\]"', ln) for ln in instructions)
