"""Local folders stay local, and cached Hub ids merge offline, through every tool.

A model folder written without ``./`` (``models/post``) is merged by ``graftmerge merge``,
the stock ``mergekit-yaml`` and ``run_merge`` exactly as ``./models/post`` is, offline and
online, with every network request failing the test: huggingface_hub's client gets a
transport that records and refuses each request (no offline hook in front of it, so even
offline a request would reach it), and sockets refuse to connect. One real ``mergekit-yaml``
process runs online against a local server standing in for the Hub and for every proxy, which
must see no request. A Hub id in the local Hugging Face cache merges offline through the stock
``mergekit-yaml`` into the bits ``graftmerge merge`` writes; one that is not cached is one
``error:`` line, exit 2, nothing written.
"""

from __future__ import annotations

import http.server
import socket
import threading
from pathlib import Path
from types import SimpleNamespace

import httpx2
import pytest
import yaml
from huggingface_hub import constants, set_client_factory
from huggingface_hub.utils._http import default_client_factory
from mergekit.config import MergeConfiguration
from mergekit.options import MergeOptions

from graftmerge.adapter import import_hook, mergekit_compat
from graftmerge.adapter.mergekit_compat import names_a_hub_repo
from graftmerge.demo.tiny_models import make_graft_inputs
from graftmerge.errors import GraftError
from tests.helpers.configs import graft_yaml
from tests.helpers.data_aware import config as data_aware_yaml
from tests.helpers.data_aware import make_models, write_both_cache
from tests.helpers.fisher_caches import write_diagonal_cache
from tests.helpers.hf_cache import place_in_hf_cache
from tests.helpers.runners import error_line, forget_process_state, run_cli, run_process

METHODS = ("graft", "fisher", "regmean", "linear")  # linear: mergekit's own card, asking nothing of the Hub either


def config_text(method: str, prefix: str, models: dict[str, str] | None = None) -> str:
    """``method``'s config over the workspace's folders, each written as ``prefix`` + its relative path
    (or as ``models`` names it: a Hub id)."""
    named = {key: models.get(key, prefix + key) if models else prefix + key
             for key in ("models/post", "models/base", "models/base-ft", "peers/m0", "peers/m1")}
    if method == "graft":
        return graft_yaml(named["models/post"], named["models/base"], [(named["models/base-ft"], 0.5)],
                          rho=0.05 if models is None else 0.0, fisher=f"{prefix}fisher/post-diag")
    if method == "linear":
        return (f"merge_method: linear\nmodels:\n  - model: {named['models/post']}\n    parameters: {{weight: 0.3}}\n"
                f"  - model: {named['models/base']}\n    parameters: {{weight: 0.7}}\ndtype: float32\n")
    extra = {"alpha": 0.9} if method == "regmean" else {}
    return data_aware_yaml(method, [named["peers/m0"], named["peers/m1"]],
                           [f"{prefix}peers/fisher0", f"{prefix}peers/fisher1"], [0.6, 0.4], **extra)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """The folder a user merges from: models/{post,base,base-ft} with fisher/post-diag (graft, linear), and
    peers/m0, m1 with their caches peers/fisher0, 1 (fisher, regmean)."""
    root = tmp_path_factory.mktemp("workspace")
    make_graft_inputs(root / "models", seed=0, tie_word_embeddings=True)
    write_diagonal_cache(root / "fisher" / "post-diag", root / "models" / "post")
    for index, model in enumerate(make_models(root / "peers", "qwen3-tied", count=2)):
        write_both_cache(root / "peers" / f"fisher{index}", model, seed=100 + index)
    return root


def run_merge_in_process(config: str, out: Path) -> None:
    """``mergekit.merge.run_merge`` (the hook's wrapped one) on the config text, as a Python caller runs it."""
    import_hook.install()
    from mergekit.merge import run_merge

    forget_process_state()
    try:
        run_merge(MergeConfiguration.model_validate(yaml.safe_load(config)), str(out),
                  options=MergeOptions(quiet=True))
    finally:
        forget_process_state()


@pytest.fixture(scope="module")
def references(workspace, tmp_path_factory) -> dict[str, dict[str, bytes]]:
    """Each method merged with ``./`` paths (what always worked): its files' bytes, the card files aside."""
    root = tmp_path_factory.mktemp("references")
    found = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(workspace)
        for method in METHODS:
            run_merge_in_process(config_text(method, "./"), root / method)
            found[method] = model_files(root / method)
    return found


def model_files(folder: Path) -> dict[str, bytes | None]:
    """Every file a merge published, by name; the model's bytes (weights, index, config.json). The card files
    show the config's spelling, and a reserialized tokenizer_config.json records how it was loaded (offline)."""
    return {path.name: path.read_bytes() if path.name.endswith((".safetensors", ".index.json", "config.json"))
            and path.name != "tokenizer_config.json" else None for path in sorted(folder.iterdir())}


@pytest.fixture
def no_network(monkeypatch) -> list[str]:
    """Every request huggingface_hub makes fails and is listed; so does any other socket connection."""
    tried: list[str] = []

    def refuse(request: httpx2.Request) -> httpx2.Response:
        tried.append(f"{request.method} {request.url}")
        raise httpx2.ConnectError("the network is blocked in this test", request=request)

    def refuse_socket(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6):
            tried.append(f"connect {address}")
            raise OSError("the network is blocked in this test")
        return connect(self, address)

    connect = socket.socket.connect
    monkeypatch.setattr(socket.socket, "connect", refuse_socket)
    set_client_factory(lambda: httpx2.Client(transport=httpx2.MockTransport(refuse), follow_redirects=True))
    yield tried
    set_client_factory(default_client_factory)


def hub_mode(monkeypatch, offline: bool) -> None:
    """huggingface_hub offline (HF_HUB_OFFLINE=1) or online, for this process and the merges it runs."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1" if offline else "0")


def merge_with(tool: str, config: str, out: Path, cwd: Path) -> None:
    """``config`` merged into ``out`` from ``cwd`` by ``tool``: graftmerge merge, mergekit-yaml or run_merge."""
    if tool == "run_merge":
        run_merge_in_process(config, out)
        return
    (out.parent / f"{out.name}.yml").write_text(config)
    command = ("graftmerge", "merge") if tool == "graftmerge" else ("mergekit-yaml",)
    result = run_cli(*command, str(out.parent / f"{out.name}.yml"), str(out), cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]


# -- issue 41: a relative folder without ./ is a folder -------------------------------------------


# every tool offline; online (where mergekit's card would have asked the Hub), the stock CLI
TOOLS_AND_MODES = [("graftmerge", True), ("mergekit-yaml", True), ("run_merge", True), ("mergekit-yaml", False)]


@pytest.mark.parametrize(("tool", "offline"), TOOLS_AND_MODES,
                         ids=[f"{tool}-{'offline' if offline else 'online'}" for tool, offline in TOOLS_AND_MODES])
@pytest.mark.parametrize("method", METHODS)
def test_relative_folders_merge_as_dot_slash_ones_without_the_network(
        method, tool, offline, workspace, references, no_network, tmp_path, monkeypatch):
    hub_mode(monkeypatch, offline)
    monkeypatch.chdir(workspace)
    out = tmp_path / "out"
    merge_with(tool, config_text(method, ""), out, workspace)
    assert no_network == []
    assert model_files(out) == references[method]
    card = (out / "README.md").read_text()  # folders named as written, none linked to the Hub
    assert ("peers/m0" if method in ("fisher", "regmean") else "models/post") in card
    assert "huggingface.co/models/" not in card and "huggingface.co/peers/" not in card


def test_the_card_question_is_answered_on_disk(workspace, monkeypatch, no_network):
    """A path that exists is a folder however it is written; one that does not keeps mergekit's rule."""
    monkeypatch.chdir(workspace)
    assert not any(names_a_hub_repo(path) for path in ("models/post", "models", "peers/m0", "./models/post", ""))
    assert names_a_hub_repo("acme/not-here") and names_a_hub_repo("not-here")
    assert not names_a_hub_repo("/abs/not-here") and not names_a_hub_repo("a/b/not-here")
    assert no_network == []


class _Recorder(http.server.BaseHTTPRequestHandler):
    """Stands in for the Hub and for every proxy: lists each request and answers 503."""

    def _refuse(self) -> None:
        self.server.seen.append(f"{self.command} {self.path}")
        self.send_response(503)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_HEAD = do_POST = do_PUT = do_CONNECT = _refuse

    def log_message(self, *args) -> None:
        """Quiet: the test reads ``seen``."""


def test_the_stock_console_script_online_sends_no_folder_name_anywhere(workspace, references, tmp_path):
    """A real mergekit-yaml process, online, its Hub endpoint and every proxy a local recorder: a graft of
    relative folders publishes the reference bits, and the recorder sees no request at all."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    server.seen = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    address = f"http://127.0.0.1:{server.server_address[1]}"
    config = tmp_path / "graft.yml"
    config.write_text(config_text("graft", ""))
    env = {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": address, "HTTP_PROXY": address, "HTTPS_PROXY": address,
           "ALL_PROXY": address, "NO_PROXY": "", "http_proxy": address, "https_proxy": address, "no_proxy": ""}
    try:
        result = run_process("mergekit-yaml", str(config), str(tmp_path / "out"), cwd=workspace, env=env)
    finally:
        server.shutdown()
        server.server_close()
    assert result.returncode == 0, result.stderr[-3000:]
    assert server.seen == []
    assert model_files(tmp_path / "out") == references["graft"]


def test_the_hook_keeps_the_card_off_the_hub_and_wraps_run_merge_once():
    import_hook.install()
    import_hook.install()
    import mergekit.card
    import mergekit.merge

    assert mergekit.card.is_hf is mergekit_compat.names_a_hub_repo
    wrapper = mergekit.merge.run_merge
    assert hasattr(wrapper, mergekit_compat.WRAPPED) and not hasattr(wrapper.__wrapped__, mergekit_compat.WRAPPED)
    assert wrapper.__wrapped__.__module__ == "mergekit.merge"


def test_run_merge_hands_routes_and_mergekit_the_view_and_the_card_the_config_as_written():
    calls = []
    module = SimpleNamespace(run_merge=lambda config, out, options=None, config_source=None:
                             calls.append(("mk", config.name, config_source)))
    routes = {"graft": lambda original, config, out, options, source: calls.append(("graft", config.name, source))}
    written = {method: SimpleNamespace(merge_method=method, name="as written", to_yaml=lambda: "yaml as written")
               for method in ("graft", "linear")}
    mergekit_compat.wrap_run_merge(module, routes, view=lambda config: SimpleNamespace(
        merge_method=config.merge_method, name="resolved"))
    module.run_merge(written["graft"], "out", None)
    module.run_merge(written["linear"], "out", None, config_source="the user's file")
    assert calls == [("graft", "resolved", "yaml as written"), ("mk", "resolved", "the user's file")]


# -- issue 36.8: cached Hub ids through the stock CLI, offline ----------------------------------


HUB_IDS = {"models/post": "acme/tiny-post", "models/base": "acme/tiny-base@v2", "models/base-ft": "acme/tiny-ft",
           "peers/m0": "acme/peer-0", "peers/m1": "acme/peer-1"}


@pytest.fixture(scope="module")
def hf_cache(workspace, tmp_path_factory) -> Path:
    """The workspace's models as the Hugging Face cache keeps downloads of HUB_IDS (acme/tiny-base at v2)."""
    cache = tmp_path_factory.mktemp("hf-cache")
    for folder, hub_id in HUB_IDS.items():
        repo, _, revision = hub_id.partition("@")
        snapshot = place_in_hf_cache(cache, repo, workspace / folder)
        if revision:
            (cache / ("models--" + repo.replace("/", "--")) / "refs" / revision).write_text(snapshot.name)
    return cache


@pytest.fixture
def offline_hub_cache(hf_cache, monkeypatch, no_network) -> Path:
    """Offline, network blocked, with ``hf_cache`` as the Hugging Face cache."""
    hub_mode(monkeypatch, True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(hf_cache))
    return hf_cache


@pytest.mark.parametrize("method", ["graft", "linear"])
def test_cached_hub_ids_merge_offline_through_the_stock_cli(method, workspace, references, offline_hub_cache,
                                                            no_network, tmp_path, monkeypatch):
    """mergekit-yaml offline gives what graftmerge merge gives (and what the local folders give, at ρ = 0 too:
    the reference graft masks; this one reads no cache, so it is compared with graftmerge merge only)."""
    monkeypatch.chdir(workspace)
    config = config_text(method, "./", HUB_IDS)
    outputs = {}
    for tool in ("mergekit-yaml", "graftmerge", "run_merge"):
        merge_with(tool, config, tmp_path / tool, workspace)
        outputs[tool] = model_files(tmp_path / tool)
    assert outputs["mergekit-yaml"] == outputs["graftmerge"] == outputs["run_merge"]
    if method == "linear":
        assert outputs["mergekit-yaml"] == references["linear"]
    assert no_network == []


@pytest.mark.parametrize("method", ["graft", "linear", "fisher"])
@pytest.mark.parametrize("tool", ["mergekit-yaml", "graftmerge"])
def test_an_uncached_hub_id_offline_is_one_line(method, tool, workspace, offline_hub_cache, no_network, tmp_path,
                                                monkeypatch):
    monkeypatch.chdir(workspace)
    config = tmp_path / "missing.yml"
    config.write_text(config_text(method, "./", {**HUB_IDS, "models/base": "acme/not-downloaded",
                                                 "peers/m1": "acme/not-downloaded"}))
    command = ("graftmerge", "merge") if tool == "graftmerge" else ("mergekit-yaml",)
    line = error_line(run_cli(*command, str(config), str(tmp_path / "out"), cwd=workspace))
    assert "acme/not-downloaded" in line and "hf download acme/not-downloaded" in line
    assert not (tmp_path / "out").exists() and no_network == []


def test_an_uncached_hub_id_offline_from_python_is_a_graft_error(workspace, offline_hub_cache, tmp_path,
                                                                 monkeypatch):
    monkeypatch.chdir(workspace)
    with pytest.raises(GraftError, match="hf download acme/not-downloaded"):
        run_merge_in_process(config_text("linear", "./", {"models/post": "acme/not-downloaded"}), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_missing_relative_folder_offline_says_how_to_write_a_folder(workspace, offline_hub_cache, tmp_path,
                                                                      monkeypatch):
    """A typo in a folder without ./ is neither a folder nor a cached id: one line, pointing at both."""
    config = tmp_path / "typo.yml"
    config.write_text(config_text("linear", "", {"models/base": "models/bsae"}))
    line = error_line(run_cli("mergekit-yaml", str(config), str(tmp_path / "out"), cwd=workspace))
    assert "models/bsae" in line and "./models/bsae" in line
