"""llama.cpp's own server as a peer: started, waited for and always stopped (on a stand-in program
here), and, where ``specplay peers build-server`` has built it, the real one: its flags, its chat
template's prompt tokens, and the two peers in a bench."""

import os
import re
import stat
import sys
import textwrap
import time
from pathlib import Path

import pytest

from specplay.core.errors import ModelError
from specplay.core.models.llamacpp import LlamaSettings
from specplay.core.remote import llama_server
from specplay.core.remote.endpoint import Endpoint
from specplay.core.remote.llama_server import LlamaServer, server_args
from specplay.core.remote.runs import stream_completion

ROOT = Path(__file__).resolve().parents[2]

# A stand-in for llama-server: answers /health and streams a completion with llama.cpp's timings, as
# the real one does; BEHAVIOUR says whether it serves, dies at start or never becomes healthy.
STAND_IN = textwrap.dedent("""\
    #!{python}
    import json, sys, time
    from http.server import BaseHTTPRequestHandler, HTTPServer
    behaviour = {behaviour!r}
    if behaviour == "die":
        print("error: this model cannot be loaded", flush=True)
        sys.exit(3)
    port = int(sys.argv[sys.argv.index("--port") + 1])

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            ok = behaviour == "serve"
            self.send_response(200 if ok else 503)
            self.end_headers()
            self.wfile.write(b'{{"status": "ok"}}' if ok else b'{{"status": "loading model"}}')

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with open(sys.argv[0] + ".request", "w") as f:
                json.dump(body, f)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            events = [{{"choices": [{{"text": "ab", "index": 0, "finish_reason": None}}]}},
                      {{"choices": [{{"text": " cd", "index": 0, "finish_reason": "stop"}}],
                       "timings": {{"predicted_n": 5, "draft_n": 4, "draft_n_accepted": 3}}}}]
            for e in events:
                self.wfile.write(b"data: " + json.dumps(e).encode() + b"\\n\\n")
            self.wfile.write(b"data: [DONE]\\n\\n")

    HTTPServer(("127.0.0.1", port), H).serve_forever()
    """)


def _stand_in(tmp_path: Path, behaviour: str) -> Path:
    path = tmp_path / f"llama-server-{behaviour}"
    path.write_text(STAND_IN.format(python=sys.executable, behaviour=behaviour))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def test_the_server_is_built_from_the_peers_extras_pin():
    text = (ROOT / "pyproject.toml").read_text()
    assert f'"{llama_server.SOURCE.replace("==", "[server]==")}"' in text


def test_a_missing_server_names_the_command_that_builds_it(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPLAY_LLAMA_SERVER", str(tmp_path / "nowhere" / "llama-server"))
    why = llama_server.why_unavailable()
    assert why and "specplay peers build-server" in why


def test_a_started_server_answers_and_is_gone_after_its_block(tmp_path):
    path = _stand_in(tmp_path, "serve")
    with LlamaServer(["-m", "x.gguf"], path=path) as server:
        proc = server.proc
        run = stream_completion(Endpoint(server.url, model="m"), "shown", max_tokens=4, chat=False,
                                prompt_tokens=[5, 6, 7], fields={"cache_prompt": False})
        log = server.log_path
    assert proc.poll() is not None and not log.exists()
    assert run.error is None and run.text == "ab cd"
    assert run.speculation.drafted == 4 and run.speculation.accepted == 3 and run.speculation.steps == 2
    sent = __import__("json").loads(Path(str(path) + ".request").read_text())
    assert sent["prompt"] == [5, 6, 7] and sent["cache_prompt"] is False  # the ids themselves, not their text


def test_a_server_that_dies_while_starting_is_refused_with_its_words(tmp_path):
    with pytest.raises(ModelError, match=r"exited with code 3 while starting: error: this model cannot be loaded"):
        LlamaServer([], path=_stand_in(tmp_path, "die")).start()


def test_a_server_that_never_becomes_ready_is_stopped(tmp_path):
    server = LlamaServer([], path=_stand_in(tmp_path, "loading"), timeout_s=1.5)
    with pytest.raises(ModelError, match="did not answer within 2 s"):
        server.start()
    assert server.proc is None  # stopped, not left running


def test_the_bench_stops_its_servers_when_it_is_interrupted(tmp_path, monkeypatch):
    from specplay.core.measure import bench

    server = LlamaServer([], path=_stand_in(tmp_path, "serve"))
    server.start()
    proc = server.proc

    class Peer:
        def close(self):
            server.stop()

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench, "_load_runners", lambda *a: ({"llamacpp_ngram": Peer()}, {}))
    monkeypatch.setattr(bench, "_run_loaded", interrupted)
    with pytest.raises(KeyboardInterrupt):
        bench.run_bench(None, None, [], bench.BenchSpec(methods=["autoregressive"]), tmp_path, log=lambda m: None)
    assert proc.wait(5) is not None


def test_a_server_peer_that_cannot_start_is_refused_with_the_reason_and_the_bench_goes_on(tmp_path, monkeypatch):
    import torch

    from specplay.core.measure import peers
    from specplay.core.measure.bench import BenchSpec, run_bench
    from specplay.core.measure.prompts import Question
    from tiny import loaded, tiny_pair

    dying = _stand_in(tmp_path, "die")
    monkeypatch.setattr(peers, "server_for", lambda name, target, draft: (LlamaServer([], path=dying), {}))
    target = loaded(tiny_pair(dtype=torch.float64)[0])
    spec = BenchSpec(methods=["autoregressive", "llamacpp_ngram"], max_new_tokens=4, chat_template=False, warmup=0)
    result = run_bench(target, None, [Question(1, "code", ("ab cd",))], spec, tmp_path, log=lambda m: None)
    refused = result["summary"]["llamacpp_ngram"]["overall"]
    assert refused["failures"] == 1 and "exited with code 3 while starting" in refused["errors"][0]
    assert result["summary"]["autoregressive"]["overall"]["failures"] == 0


def test_a_server_peers_own_count_of_steps_is_its_tau_and_is_read_back(tmp_path, monkeypatch):
    import torch

    from specplay.core.measure import peers
    from specplay.core.measure.bench import BenchSpec, run_bench
    from specplay.core.measure.prompts import Question
    from tiny import loaded, tiny_pair

    serving = _stand_in(tmp_path, "serve")
    started = []

    def server_for(name, target, draft):
        started.append(LlamaServer([], path=serving))
        return started[-1], {"command": "llama-server ..."}

    monkeypatch.setattr(peers, "server_for", server_for)
    target = loaded(tiny_pair(dtype=torch.float64)[0])
    spec = BenchSpec(methods=["autoregressive", "llamacpp_ngram"], max_new_tokens=4, chat_template=False, warmup=0)
    for _ in range(2):  # the second run reads the answers back
        result = run_bench(target, None, [Question(1, "code", ("ab cd",))], spec, tmp_path / "out", log=lambda m: None)
        entry = result["summary"]["llamacpp_ngram"]["overall"]
        # "ab cd" is 5 tokens of the target's, made in 2 steps of the server's (5 generated, 3 of them accepted)
        assert entry["mean_accepted"] == pytest.approx(2.5) and entry["acceptance_rate"] == pytest.approx(3 / 4)
    assert len(started) == 2 and all(s.proc is None for s in started)  # each run's server stopped


def test_options_follow_the_probes_settings():
    args = server_args(Path("t.gguf"), 3, LlamaSettings(extra_buffers=False, flash_attn=True), draft=Path("d.gguf"))
    assert "--no-repack" in args and args[args.index("-fa") + 1] == "on" and args[args.index("-t") + 1] == "3"
    assert args[args.index("-md") + 1] == "d.gguf" and args[args.index("--spec-type") + 1] == "draft-simple"
    plain = server_args(Path("t.gguf"), 2, LlamaSettings(extra_buffers=True, flash_attn=False), spec_type="ngram-mod")
    assert "--no-repack" not in plain and "-md" not in plain and plain[plain.index("--spec-type") + 1] == "ngram-mod"


# ----------------------------------------------------------------------------- the real server
def _need_server():
    from conftest import require_or_skip

    why = llama_server.why_unavailable()
    if why:
        require_or_skip("SPECPLAY_REQUIRE_PEERS", why)


def _need_default_models():
    from conftest import require_or_skip
    from specplay.core.weights.catalog import CATALOG, DEFAULT_DRAFT, DEFAULT_TARGET

    if not (CATALOG[DEFAULT_TARGET].installed() and CATALOG[DEFAULT_DRAFT].installed()):
        require_or_skip("SPECPLAY_REQUIRE_REAL_MODELS", "the default models are not installed")


def test_every_option_specplay_passes_is_one_the_built_server_knows():
    _need_server()
    text = llama_server.server_help()
    known = set(re.findall(r"(?<![\w-])(--?[a-z][a-z0-9-]*)", text))
    ours = {a for a in server_args(Path("t"), 2, LlamaSettings(False, True), draft=Path("d"), spec_type="x")
            + ["--host", "--port"] if a.startswith("-")}
    assert ours <= known, sorted(ours - known)
    for kind in llama_server.NGRAM_TYPES + ("draft-simple",):
        assert kind in text  # the --spec-type values, as this build lists them


def _settings(gguf):
    from specplay.core.models.llamacpp import fastest_safe, usable_settings

    _, probes = usable_settings(gguf, 2)
    settings = fastest_safe(probes)
    if settings is None:
        pytest.skip("llama.cpp is unsafe on this CPU")
    return settings


@pytest.mark.real_model
def test_the_servers_chat_template_gives_our_prompt_tokens():
    import json

    _need_server()
    _need_default_models()
    from specplay.core.measure.peers import gguf_file
    from specplay.core.models import load_model
    from specplay.core.remote.transport import Connection
    from specplay.core.text import encode_messages
    from specplay.core.weights.catalog import DEFAULT_TARGET

    target = load_model(DEFAULT_TARGET, "cpu")
    gguf, tok = gguf_file(target), target.tokenizer
    conversations = [[{"role": "user", "content": "Write a Python function that reverses a string."}],
                     [{"role": "user", "content": "Übersetze: «naïve café» — 東京"},
                      {"role": "assistant", "content": "Translate: \"naive cafe\""},
                      {"role": "user", "content": "  and now\n\ttabs  "}]]
    with LlamaServer(server_args(gguf, 2, _settings(gguf))) as server:
        ep = Endpoint(f"http://127.0.0.1:{server.port}")

        def post(path, body):
            conn = Connection(ep, time.monotonic() + 60)
            try:
                resp = conn.request("POST", path, body)
                assert resp.status == 200
                return json.loads(b"".join(conn.pieces()))
            finally:
                conn.close()

        for messages in conversations:
            prompt = post("/apply-template", {"messages": messages})["prompt"]
            theirs = post("/tokenize", {"content": prompt, "add_special": True, "parse_special": True})["tokens"]
            ours = encode_messages(tok, messages)
            assert len(theirs) == len(ours) and theirs == ours


def _children_named(name: str) -> list[int]:
    """This process's live children running ``name`` (Linux: read from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                comm = (entry / "comm").read_text().strip()
            except OSError:
                continue
            if int(fields[1]) == os.getpid() and comm == name and fields[0] != "Z":
                found.append(int(entry.name))
    return found


@pytest.mark.real_model
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_two_server_peers_in_a_bench_report_their_drafts_and_leave_no_process(tmp_path, monkeypatch):
    _need_server()
    _need_default_models()
    from specplay.core.measure import peers
    from specplay.core.measure.bench import BenchSpec, run_bench
    from specplay.core.measure.prompts import Question
    from specplay.core.models import load_model
    from specplay.core.weights.catalog import DEFAULT_DRAFT, DEFAULT_TARGET

    # A short calibration, over two of the types, chooses the n-gram type for this test.
    monkeypatch.setattr(peers, "NGRAM_CALIBRATION_TOKENS", 8)
    monkeypatch.setattr(llama_server, "NGRAM_TYPES", ("ngram-simple", "ngram-mod"))
    target, draft = load_model(DEFAULT_TARGET, "cpu"), load_model(DEFAULT_DRAFT, "cpu")
    spec = BenchSpec(methods=["autoregressive", "llamacpp_speculative", "llamacpp_ngram"], max_new_tokens=24,
                     warmup=0)
    question = Question(1, "code", ("Repeat this line exactly twice: the quick brown fox jumps over the lazy dog.",))
    result = run_bench(target, draft, [question], spec, tmp_path, log=lambda m: None)
    assert _children_named("llama-server") == []
    for name in ("llamacpp_speculative", "llamacpp_ngram"):
        entry = result["summary"][name]["overall"]
        assert entry["failures"] == 0, entry["errors"]
        assert entry["tokens_per_s"] > 0 and entry["time_to_first_token"] > 0
    speculative = result["summary"]["llamacpp_speculative"]["overall"]
    assert speculative["mean_accepted"] > 1 and 0 < speculative["acceptance_rate"] <= 1  # from the server's counts
    import json

    card = json.loads((tmp_path / "summary.json").read_text())["params"]
    assert card["llamacpp_ngram"]["spec_type"] in ("ngram-simple", "ngram-mod")
    assert "-md" in card["llamacpp_speculative"]["command"] and "--spec-type ngram" in card["llamacpp_ngram"]["command"]


# ----------------------------------------------------------------------------- tuning the server's draft
def test_the_servers_default_draft_size_is_read_from_its_help():
    from specplay.core.measure.tune_server import default_n_max

    text = ("--spec-draft-n-max N                    number of tokens to draft for speculative decoding "
            "(default: 3)\n                                        (env: LLAMA_ARG_SPEC_DRAFT_N_MAX)\n")
    assert default_n_max(text) == 3
    with pytest.raises(ModelError, match="no default for --spec-draft-n-max"):
        default_n_max("--draft-max N  the argument has been removed")


def test_a_server_step_pays_the_drafts_passes_its_block_and_the_verification():
    from specplay.core.decoding.costmodel import CostCurve
    from specplay.core.measure.tune_server import ServerStepCosts

    costs = ServerStepCosts(verify=CostCurve((1, 4), (0.08, 0.2)), draft_unit=0.02, other=0.005, prefill=0.5,
                            draft_block=CostCurve((1, 4), (0.02, 0.03)))
    # three drafted: three one-token draft passes, the draft's and the target's pass over the 4 verified
    assert costs.step(3, 3) == pytest.approx(3 * 0.02 + 0.03 + 0.2 + 0.005)
    assert set(costs.to_dict()["draft_block_ms"]) == {"1", "4"}


@pytest.mark.real_model
def test_tuning_the_servers_draft_size_predicts_each_size_and_proves_two(tmp_path):
    """Through the command line, in a process of its own: the tune opens llama.cpp in its process, and a
    later test's llama.cpp draft in this one should not share a heap with it."""
    import json
    import subprocess

    from specplay.core.measure import tune_server

    _need_server()
    _need_default_models()
    cmd = [sys.executable, "-c", "import sys; from specplay.core.cli import main; sys.exit(main())", "tune",
           "--method", "llamacpp_speculative", "--max-new-tokens", "24", "--warmup-tokens", "2", "--json",
           "--prompt", "Write a Python function that returns the largest of three numbers."]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert [s["params"]["n_max"] for s in result["settings"]] == list(tune_server.DRAFT_SIZES)
    assert result["default"]["params"] == {"n_max": 3} and result["base_params"] == {"n_max": 3}
    for trial in (result["default"], result["best"]):
        assert trial["measured_tokens_per_s"] > 0 and trial["predicted_tokens_per_s"] > 0
        assert len(trial["measured_runs"]) == 2 and trial["measured_tau"] >= 1
    assert result["autoregressive_tokens_per_s"] > 0 and result["baseline"] == "plain llama-server"
    best = result["best"]["params"]["n_max"]
    assert ("--spec-draft-n-max" in result["command"]) == (best != 3) and " -md " in result["command"]
    plain_faster = result["autoregressive_tokens_per_s"] > result["best"]["measured_tokens_per_s"]
    assert bool(result.get("notes")) == plain_faster and all("drop -md" in n for n in result.get("notes", []))
