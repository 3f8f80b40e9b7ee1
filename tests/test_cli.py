"""The command-line tools, run as a user runs them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from meshd.models.builtin import directory_digest


def meshctl(*args: str, home=None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if home is not None:
        env["MESHD_HOME"] = str(home)
    return subprocess.run([sys.executable, "-m", "meshd.cli.meshctl_main", *args], capture_output=True, text=True,
                          env=env, timeout=300, check=False)


def test_model_create_writes_the_builtin_model(tmp_path, tiny_model):
    out = tmp_path / "m"
    run = meshctl("model", "create", "tiny", "--out", str(out))
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == str(out)
    assert directory_digest(out) == directory_digest(tiny_model)
    again = meshctl("model", "create", "tiny", "--out", str(out))
    assert again.returncode == 1 and "already exists" in again.stderr


def test_model_create_rejects_unknown_names(tmp_path):
    run = meshctl("model", "create", "giant", "--out", str(tmp_path / "x"))
    assert run.returncode == 2 and "invalid choice" in run.stderr


def test_demo_reports_identical(tmp_path):
    run = meshctl("demo", home=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "identical:" in run.stdout
    assert (tmp_path / "models" / "tiny" / "config.json").is_file()


def meshd(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshd.cli.meshd_main", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=120, check=False)


def test_a_bad_setting_is_one_line_and_exit_status_2(tmp_path):
    run = meshd("run", "--listen", "127.0.0.1:99999", cwd=tmp_path)
    assert run.returncode == 2
    assert run.stderr.strip() == ("meshd: bad configuration: listen: bad address '127.0.0.1:99999': "
                                  "port 99999 is outside 0-65535")
    assert not (tmp_path / "meshd-data").exists(), "nothing may start before the settings are valid"


def test_join_takes_its_invite_once(tmp_path):
    run = meshd("join", "TOKEN", "--invite", "OTHER", cwd=tmp_path)
    assert run.returncode == 2
    assert run.stderr.strip() == "meshd: join takes its invite as TOKEN; give --invite only to meshd run"
    assert not (tmp_path / "meshd-data").exists()


def test_a_port_in_use_is_one_line_naming_the_listener(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for flag, what in (("--listen", "the peer transport"), ("--api", "the OpenAI API"),
                           ("--control", "the control API")):
            addresses = {"--listen": "127.0.0.1:0", "--api": "127.0.0.1:0", "--control": "127.0.0.1:0",
                         "--metrics": "127.0.0.1:0",
                         flag: f"127.0.0.1:{port}"}
            run = meshd("run", *[x for pair in addresses.items() for x in pair], "--data-dir", str(tmp_path / "d"),
                        cwd=tmp_path)
            assert run.returncode == 1, run.stderr
            assert "Traceback" not in run.stderr
            last = run.stderr.strip().splitlines()[-1]
            assert last.endswith(f"meshd stopped: cannot listen for {what} on 127.0.0.1:{port}: Address already in use")


def test_every_daemon_command_fails_in_one_line_when_the_daemon_is_down(tmp_path):
    import socket

    with socket.socket() as s:  # a port that was free a moment ago and has no listener now
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for argv in (["peers"], ["status"], ["models"], ["route", "tiny"], ["sessions"], ["logs"], ["chat", "hi"],
                 ["peers", "--json"]):
        run = meshctl(*argv, "--control", f"127.0.0.1:{port}", "--timeout", "5")
        assert run.returncode == 1, (argv, run.stderr)
        lines = run.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"meshctl: cannot reach the daemon's control API at "
                                                       f"127.0.0.1:{port}"), (argv, run.stderr)
        assert run.stdout == ""


class _NotMeshd:
    """An HTTP server on loopback answering every GET with ``get`` and every POST with ``post``
    (status, body): a program that is not meshd on the control port, or an API that refuses."""

    def __init__(self, get: tuple[int, bytes], post: tuple[int, bytes] = (404, b"")) -> None:
        import http.server
        import threading

        answers = {"GET": get, "POST": post}

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                self.rfile.read(length)
                status, body = answers[self.command]
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> _NotMeshd:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


def _one_line(run: subprocess.CompletedProcess, code: int, *parts: str) -> None:
    lines = run.stderr.strip().splitlines()
    assert run.returncode == code and len(lines) == 1, (run.returncode, run.stderr)
    assert all(part in lines[0] for part in parts), lines[0]


def test_a_control_address_that_is_not_meshd_is_one_line():
    with _NotMeshd((200, b"<html>hello</html>")) as other:
        _one_line(meshctl("status", "--control", other.address, "--timeout", "5"), 1,
                  "answered, but not as meshd's control API")
    _one_line(meshctl("status", "--control", "127.0.0.1:abc", "--timeout", "5"), 1, "cannot reach")


def test_chat_refused_by_the_api_is_one_line():
    import json

    refusal = {"error": {"message": "The model 'nope' does not exist", "type": "invalid_request_error",
                         "param": "model", "code": "model_not_found"}}
    with _NotMeshd((200, b""), (404, json.dumps(refusal).encode())) as api:
        status = json.dumps({"api": api.address, "models_covered": ["tiny"]}).encode()
        with _NotMeshd((200, status)) as control:
            run = meshctl("chat", "hi", "--model", "nope", "--control", control.address, "--timeout", "5")
    _one_line(run, 1, f"the API at {api.address} answered 404", "The model 'nope' does not exist")
    assert "Traceback" not in run.stderr


def test_ordinary_mistakes_are_one_line_not_a_traceback(tmp_path):
    _one_line(meshctl("doctor", "--model", str(tmp_path), "--device", "bogus"), 2, "unknown device 'bogus'")
    _one_line(meshctl("doctor", "--model", str(tmp_path), "--device", "cuda:x"), 2, "unknown device 'cuda:x'")
    run = meshctl("model", "create", "tiny", "--out", "/proc/meshd-cannot-write-here")  # a progress line, then why
    assert run.returncode == 1 and run.stderr.strip().splitlines()[-1].startswith("meshctl: ") and "Traceback" \
        not in run.stderr, run.stderr
    _one_line(meshctl("demo", "--model", str(tmp_path / "absent")), 2, "is not a model directory")
    run = meshctl("logs", "-n", "0")
    assert run.returncode == 2 and "at least 1, not 0" in run.stderr
    for bad in (["--seconds", "0"], ["--seconds", "nan"], ["--latency-ms", "-10"]):
        run = meshctl("sim", "--peers", "2", *bad)
        assert run.returncode == 2 and "a positive number" in run.stderr, (bad, run.stderr)
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "identity.key").write_text("not a key\n")
    (tmp_path / "state" / "identity.key").chmod(0o600)
    _one_line(meshd("init", "--config", "peer.toml", "--data-dir", "state", cwd=tmp_path), 1, "identity key")
    assert not (tmp_path / "peer.toml").exists()


def test_json_logs_are_one_object_per_line_naming_the_peer(tmp_path):
    import json
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        run = meshd("run", "--listen", f"127.0.0.1:{taken.getsockname()[1]}", "--api", "127.0.0.1:0",
                    "--control", "127.0.0.1:0", "--metrics", "127.0.0.1:0", "--log-format", "json",
                    "--data-dir", str(tmp_path / "d"), cwd=tmp_path)
    assert run.returncode == 1
    docs = [json.loads(line) for line in run.stderr.strip().splitlines()]
    assert docs[-1]["level"] == "error" and "cannot listen for the peer transport" in docs[-1]["msg"]
    assert len(docs[-1]["peer"]) > 20 and {"ts", "logger"} <= set(docs[-1])


def test_every_command_and_option_says_what_it_does():
    import argparse

    from meshd_relay.cli import build_parser as relay_parser

    from meshd.cli.meshctl_main import build_parser as meshctl_parser
    from meshd.cli.meshd_main import build_parser as meshd_parser

    silent = []

    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                helped = {a.dest for a in action._choices_actions if a.help}
                for name, sub in action.choices.items():
                    if name not in helped:
                        silent.append(f"{path} {name}")
                    walk(sub, f"{path} {name}")
            elif not isinstance(action, argparse._HelpAction) and not action.help:
                silent.append(f"{path} {'/'.join(action.option_strings) or action.dest}")

    for parser, name in ((meshd_parser(), "meshd"), (meshctl_parser(), "meshctl"), (relay_parser(), "meshd-relay")):
        walk(parser, name)
    assert silent == [], f"no --help text for: {', '.join(silent)}"


@pytest.mark.parametrize(("command", "refused"), [
    (["bench", "--serve", "--concurrency", "2", "--runs", "1"], "--serve does not take --concurrency, --runs"),
    (["bench", "--prefix", "--new-tokens", "8"], "--prefix does not take --new-tokens"),
    (["bench", "--prefill-workers", "--serve-requests", "3"], "--prefill-workers does not take --serve-requests"),
    (["bench", "--serve-rates", "0.5"], "the standard workload does not take --serve-rates"),
    (["bench", "--seed", "3", "--no-pin"], "the standard workload does not take --seed, --no-pin"),
    (["bench", "--serve", "--prefix-tokens", "64"], "--serve does not take --prefix-tokens"),
    (["bench", "--quant", "q4_k"], "does not take --quant without --format gguf"),
    (["bench", "--format", "gguf", "--model", "mine.gguf", "--quant", "f16"], "--quant with a GGUF file"),
    (["bench", "--draft-model", "draft"], "does not take --draft-model without --speculative model or auto"),
    (["bench-relay", "--model", "tiny", "--runs", "2"], "--model is for --decode; --runs is for --decode"),
    (["bench-relay", "--decode", "--link-caps", "4MB"], "--link-caps is for --compression"),
    (["bench-relay", "--compression-samples", "3"], "--compression-samples is for --compression"),
])
def test_benchmarks_refuse_options_they_would_ignore(command, refused, capsys):
    from meshd.cli import meshctl_main

    with pytest.raises(SystemExit) as exit_:
        meshctl_main.main(command)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert refused in err and len(err.strip().splitlines()) == 1


def test_each_benchmark_gets_its_own_options_defaults():
    from meshd.cli.meshctl_main import BENCH_OPTIONS, _bench_options_refused, build_parser

    for benchmark, options in BENCH_OPTIONS.items():
        flag = {"standard": [], "prefill-workers": ["--prefill-workers"]}.get(benchmark, [f"--{benchmark}"])
        args = build_parser().parse_args(["bench", *flag])
        # unset until the benchmark is known: that is how one given to another benchmark is told apart
        assert all(getattr(args, dest) is None for dest, _default in options.values())
        assert _bench_options_refused(args, benchmark) is False
        assert {dest: getattr(args, dest) for dest, _default in options.values()} == dict(options.values())
    args = build_parser().parse_args(["bench", "--serve", "--serve-clients", "2,3", "--seed", "7"])
    assert _bench_options_refused(args, "serve") is False
    assert (args.serve_clients, args.seed, args.serve_requests) == ((2, 3), 7, 8)
    args = build_parser().parse_args(["bench", "--format", "gguf", "--quant", "q4_k", "--speculative", "model",
                                      "--draft-model", "draft"])
    assert _bench_options_refused(args, "standard") is False
    assert (args.quant, args.draft_model, args.runs) == ("q4_k", "draft", 3)


def test_a_gguf_bench_refuses_what_only_the_safetensors_one_takes(capsys):
    from meshd.cli import meshctl_main

    with pytest.raises(SystemExit) as exit_:
        meshctl_main.main(["bench", "--format", "gguf", "--dtype", "bfloat16", "--speculative", "ngram"])
    assert exit_.value.code == 1
    assert "--format gguf does not take --dtype, --speculative" in capsys.readouterr().err


def test_bench_relay_fills_in_the_defaults_of_the_measurements_asked_for():
    from meshd.bench.relay_cli import LINK_CAPS, options_refused
    from meshd.cli.meshctl_main import build_parser

    args = build_parser().parse_args(["bench-relay", "--compression", "--compression-tokens", "384"])
    assert options_refused(args) is None
    assert (args.compression_tokens, args.compression_samples, args.link_caps) == (384, 20, LINK_CAPS)
    assert (args.model, args.new_tokens, args.runs) == (None, None, None)  # --decode not asked for
    args = build_parser().parse_args(["bench-relay", "--decode", "--compression"])
    assert options_refused(args) is None
    assert (args.model, args.new_tokens, args.runs, args.compression_tokens) == ("bench", 64, 3, 512)


def test_the_relay_reports_a_port_in_use_in_one_line(tmp_path):
    import json
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for flags, what in ((["--listen", f"127.0.0.1:{port}", "--metrics", ""], "the relay"),
                            (["--listen", "127.0.0.1:0", "--metrics", f"127.0.0.1:{port}"], "metrics")):
            run = subprocess.run([sys.executable, "-m", "meshd_relay.cli", *flags], capture_output=True, text=True,
                                 cwd=tmp_path, timeout=60, check=False)
            assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
            last = json.loads(run.stderr.strip().splitlines()[-1])
            assert last["msg"] == "relay stopped"
            assert last["error"] == f"cannot listen for {what} on 127.0.0.1:{port}: Address already in use"
