"""Models from object storage (pipeline/storage/model_cache.py) against moto's real S3 server on
loopback: each object is downloaded once per node even by concurrent processes, a changed
object is downloaded again and changes the fingerprint, and a killed or half copy is never
used. The job end to end with models on S3 is in tests/test_job.py (it shares that module's
run with local models)."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
import s3fs

from pipeline.cluster import ClusterPathRefused, check_cluster_paths
from pipeline.config import ConfigError, load_config, parse_config
from pipeline.job.plan import model_fingerprint, results_fingerprint
from pipeline.storage import Storage
from pipeline.storage.model_cache import MANIFEST, localize, remote_files
from tinykit import kit_paths
from tests import conftest
from tests.conftest import job_config

KIT = kit_paths()


@pytest.fixture
def s3_requests(s3_endpoint):
    """(method, path) of every request the moto server answers, from any process, recorded
    at the server's WSGI entry; `slow[prefix] = seconds` delays the GETs of objects under it."""
    server = conftest.S3_SERVER._server
    app, seen, slow = server.app, [], {}

    def recording(environ, start_response):
        method, path = environ["REQUEST_METHOD"], environ["PATH_INFO"]
        seen.append((method, path, environ.get("QUERY_STRING", "")))
        for prefix, seconds in slow.items():
            if method == "GET" and path.startswith(prefix):
                time.sleep(seconds)
        return app(environ, start_response)

    server.app = recording
    recorder = type("Requests", (), {"seen": seen, "slow": slow})()
    recorder.gets = lambda prefix: Counter(
        path[len(prefix) :]
        for method, path, query in seen
        if method == "GET" and path.startswith(prefix) and "list-type" not in query and "prefix=" not in query
    )
    yield recorder
    server.app = app


def upload(s3_endpoint: str, local: str, key: str) -> str:
    """A kit model folder copied to s3://specbatch/KEY; returns the URI."""
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint})
    for file in sorted(Path(local).iterdir()):
        if file.is_file():
            fs.put_file(str(file), f"specbatch/{key}/{file.name}")
    return f"s3://specbatch/{key}"


def put_object(s3_endpoint: str, uri: str, data: bytes) -> None:
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint})
    fs.pipe_file(uri.removeprefix("s3://"), data)


def entry_files(folder: str) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in Path(folder).iterdir() if p.name != MANIFEST}


def _localize_in_a_process(uri: str, endpoint: str, cache: str, barrier) -> tuple[str, dict[str, int], dict]:
    barrier.wait()  # all processes ask at the same moment
    folder = localize(uri, Storage(endpoint_url=endpoint, model_cache_dir=cache))
    return folder, entry_files(folder), json.loads((Path(folder) / MANIFEST).read_text())["files"]


def test_concurrent_processes_download_each_object_once(s3_endpoint, s3_requests, tmp_path):
    uri = upload(s3_endpoint, KIT["target"], f"models-{uuid.uuid4().hex[:6]}/target")
    listed = remote_files(uri, Storage(endpoint_url=s3_endpoint))
    s3_requests.slow[f"/{uri.removeprefix('s3://')}/"] = 0.2  # the copy takes a while: the others find it running
    processes = 4
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Manager().Barrier(processes)
    with ctx.Pool(processes) as pool:
        results = pool.starmap(_localize_in_a_process, [(uri, s3_endpoint, str(tmp_path), barrier)] * processes)

    gets = s3_requests.gets(f"/{uri.removeprefix('s3://')}/")
    assert gets == Counter({name: 1 for name in listed}), "each object downloaded once on the node"
    folders = {folder for folder, _, _ in results}
    assert len(folders) == 1 and Path(folders.pop()).parent == tmp_path
    for _, files, manifest in results:  # every process saw the whole entry, never a part of it
        assert files == {name: info["size"] for name, info in listed.items()} and manifest == listed
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []

    again = localize(uri, Storage(endpoint_url=s3_endpoint, model_cache_dir=str(tmp_path)))
    assert s3_requests.gets(f"/{uri.removeprefix('s3://')}/") == gets, "an entry that matches the listing is reused"
    assert again == results[0][0]


def test_a_changed_object_is_downloaded_again_and_changes_the_fingerprint(s3_endpoint, s3_requests, tmp_path):
    storage = Storage(endpoint_url=s3_endpoint, model_cache_dir=str(tmp_path))
    uri = upload(s3_endpoint, KIT["target"], f"models-{uuid.uuid4().hex[:6]}/target")
    prefix = f"/{uri.removeprefix('s3://')}/"
    first = localize(uri, storage)
    assert s3_requests.gets(prefix) == Counter({name: 1 for name in remote_files(uri, storage)})
    before = model_fingerprint(uri, storage)  # a listing and config.json: the weights are not read
    assert set(before.files) == set(remote_files(uri, storage)) and all(":" in v for v in before.files.values())
    assert s3_requests.gets(prefix)["model.safetensors"] == 1

    config = json.loads((Path(KIT["target"]) / "tokenizer_config.json").read_text())
    config["model_max_length"] = 1234
    put_object(s3_endpoint, f"{uri}/tokenizer_config.json", json.dumps(config).encode())
    after = model_fingerprint(uri, storage)
    changed = {name for name in before.files if before.files[name] != after.files[name]}
    assert changed == {"tokenizer_config.json"}
    job = parse_config(job_config("s3://specbatch/in", "s3://specbatch/out", {"target": uri, "drafter": "/d"}))
    assert results_fingerprint(job, before, None) != results_fingerprint(job, after, None)

    second = localize(uri, storage)
    assert second == first  # the same entry, replaced
    assert json.loads((Path(second) / "tokenizer_config.json").read_text())["model_max_length"] == 1234
    gets = s3_requests.gets(prefix)
    assert gets["tokenizer_config.json"] == 2, "the changed object is downloaded again"
    assert all(gets[name] == 1 for name in before.files if name not in ("tokenizer_config.json", "config.json")), (
        "unchanged objects are kept from the previous copy (hard links), not downloaded again"
    )
    assert json.loads((Path(second) / MANIFEST).read_text())["files"] == remote_files(uri, storage)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("target-")) == [
        Path(first).name,
        f"{Path(first).name}.lock",
    ], "no temp or old copy left behind"


def _localize_quietly(uri: str, endpoint: str, cache: str) -> None:
    localize(uri, Storage(endpoint_url=endpoint, model_cache_dir=cache))


def test_a_killed_download_never_leaves_an_entry_that_is_used(s3_endpoint, s3_requests, tmp_path):
    storage = Storage(endpoint_url=s3_endpoint, model_cache_dir=str(tmp_path))
    uri = upload(s3_endpoint, KIT["target"], f"models-{uuid.uuid4().hex[:6]}/target")
    prefix = f"/{uri.removeprefix('s3://')}/"
    s3_requests.slow[prefix] = 0.5
    process = multiprocessing.get_context("spawn").Process(
        target=_localize_quietly, args=(uri, s3_endpoint, str(tmp_path))
    )
    process.start()
    deadline = time.time() + 60
    while not any(f.is_file() for f in tmp_path.glob("target-*.tmp-*/*")):  # some files copied, not all
        assert time.time() < deadline and process.is_alive(), "the copy never started"
        time.sleep(0.02)
    os.kill(process.pid, signal.SIGKILL)
    process.join()
    left = [p.name for p in tmp_path.iterdir() if p.is_dir()]
    assert len(left) == 1 and ".tmp-" in left[0], f"only the temp folder, no entry: {left}"
    s3_requests.slow.clear()

    folder = localize(uri, storage)  # the dead process's lock is gone; its temp folder is not used
    listed = remote_files(uri, storage)
    assert entry_files(folder) == {name: info["size"] for name, info in listed.items()}
    assert (Path(folder) / "model.safetensors").read_bytes() == (Path(KIT["target"]) / "model.safetensors").read_bytes()
    assert not list(tmp_path.glob("*.tmp-*")), "the killed copy's temp folder is deleted"


def test_a_half_entry_without_its_manifest_is_copied_again(s3_endpoint, tmp_path):
    """A folder where the entry goes that is not a finished copy (no manifest, or a manifest of
    other ETags: copied by hand, or an older version) is replaced, never used."""
    storage = Storage(endpoint_url=s3_endpoint, model_cache_dir=str(tmp_path))
    uri = upload(s3_endpoint, KIT["target"], f"models-{uuid.uuid4().hex[:6]}/target")
    folder = Path(localize(uri, storage))
    (folder / MANIFEST).unlink()
    (folder / "model.safetensors").write_bytes(b"half")
    assert localize(uri, storage) == str(folder)
    assert (folder / "model.safetensors").read_bytes() == (Path(KIT["target"]) / "model.safetensors").read_bytes()

    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["files"]["config.json"]["etag"] = "another-version"
    (folder / MANIFEST).write_text(json.dumps(manifest))
    (folder / "config.json").write_text("{}")
    localize(uri, storage)
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_the_driver_copies_no_weights_and_configs_keep_uris(s3_endpoint, s3_requests, tmp_path, monkeypatch):
    """The driver's preflight and tokenizer need the target's config and tokenizer files only;
    relative paths in a config resolve against its folder, URIs stay as written; hub URIs are refused."""
    monkeypatch.setenv("SPECBATCH_MODEL_CACHE", str(tmp_path / "cache"))
    storage = Storage(endpoint_url=s3_endpoint)
    uri = upload(s3_endpoint, KIT["target"], f"models-{uuid.uuid4().hex[:6]}/target")
    folder = Path(localize(uri, storage, weights=False))
    assert folder.parent == tmp_path / "cache" and folder.name.endswith(".config")
    assert "model.safetensors" not in entry_files(folder) and "tokenizer.json" in entry_files(folder)
    assert "model.safetensors" not in s3_requests.gets(f"/{uri.removeprefix('s3://')}/")
    from pipeline.stages.preprocess import PreprocessSettings, Preprocessor

    assert Preprocessor(PreprocessSettings(uri, 256), storage).tokenizer.encode("def f(x):") == Preprocessor(
        PreprocessSettings(KIT["target"], 256)
    ).tokenizer.encode("def f(x):")

    config = job_config(
        "s3://specbatch/in", "out", {"target": uri, "drafter": "drafter"}, model={"path": uri, "tokenizer": "tok"}
    )
    (tmp_path / "job.yaml").write_text(json.dumps(config))
    loaded = load_config(str(tmp_path / "job.yaml"))
    assert loaded.model.path == uri and loaded.input_uri == "s3://specbatch/in"
    assert loaded.model.tokenizer == str(tmp_path / "tok") and loaded.speculative.drafter == str(tmp_path / "drafter")
    remote = parse_config(
        {
            **config,
            "output_uri": "s3://specbatch/out",
            "model": {"path": uri},
            "speculative": {**config["speculative"], "drafter": f"{uri}-drafter"},
        }
    )
    check_cluster_paths(remote, nodes=3)  # models in object storage are fine on a cluster of several nodes
    with pytest.raises(ClusterPathRefused, match="model.tokenizer") as refused:
        check_cluster_paths(loaded.model_copy(update={"output_uri": "s3://specbatch/out"}), nodes=3)
    assert "model.path" not in str(refused.value)  # the local tokenizer and drafter are refused, the URI is not
    config["speculative"]["drafter"] = "hf://meta-llama/some-eagle3"
    (tmp_path / "job.yaml").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="speculative.drafter.*model hub"):
        load_config(str(tmp_path / "job.yaml"))
