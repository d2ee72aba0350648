"""`ds4t serve` as a process: the memory plan, refusing to start, and a server killed with SIGKILL while
it writes a state to --kv-cache-dir, restarted: it uses no corrupt state."""
import argparse
import asyncio
import os
import signal
import time

import aiohttp
import pytest
import torch

from ds4t.serve import cli
from ds4t.serve.http import Server
from ds4t.serve.persistence import SUFFIX
from ds4t.batch import graphs
from ds4t.serve.planner import parse_size

from .conftest import greedy_ref, post, run, slow_server_program, stream_events


def args_for(*argv):
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd")
    cli.add_parser(sub)
    return p.parse_args(["serve", *argv])


def test_parse_size():
    assert parse_size("80GiB") == 80 << 30 and parse_size("512M") == 512 << 20 and parse_size("1.5kb") == 1500
    with pytest.raises(ValueError):
        parse_size("lots")


def test_plan_counts_every_session_at_max_ctx(model):
    server, plan = cli.build(args_for("--batched-session", "3", "--max-ctx", "128", "--plan-only"), model=model)
    assert server is None and plan.fits
    assert plan.per_slot == model.pool.bytes_per_slot(128) and plan.sessions == 3 * plan.per_slot
    assert plan.weights == model.weight_bytes() and plan.total == plan.weights + plan.sessions + plan.workspace + plan.graphs
    text = plan.format()
    assert "3 x" in text and "ctx 128" in text and "fits: yes" in text
    assert plan.graphs == graphs.memory_estimate(model, 3)   # 0 on the CPU: no CUDA graphs
    if model.device.type == "cpu":
        assert plan.graphs == 0


def test_plan_counts_cuda_graph_outputs(monkeypatch):
    """On a GPU each decode batch size 1..N keeps a graph with static fp32 logits [n, vocab]."""
    class GpuModel:
        device = torch.device("cuda")
        vocab_size = 1000

    assert graphs.memory_estimate(GpuModel(), 3) == 4 * 1000 * (1 + 2 + 3)
    monkeypatch.setenv("DS4T_CUDA_GRAPH_MAX_ROWS", "2")
    assert graphs.memory_estimate(GpuModel(), 3) == 4 * 1000 * (1 + 2)
    monkeypatch.setenv("DS4T_CUDA_GRAPHS", "0")
    assert graphs.memory_estimate(GpuModel(), 3) == 0


def test_refuses_to_start_when_the_plan_does_not_fit(capsys):
    rc = cli.run(args_for("--batched-session", "64", "--memory-limit", "4MiB", "--port", "0"))
    out = capsys.readouterr()
    assert rc == 2
    assert "fits: NO" in out.out
    assert "refusing to start" in out.err and "--memory-limit" in out.err and "Lower --batched-session" in out.err


def test_a_meta_plan_sizes_hardware_that_is_not_here(capsys):
    """--device meta --plan-only: a full-size preset planned from shapes alone (nothing drawn), CUDA graphs
    counted as the GPU would keep them; exit 0 when it fits the given memory, 2 with the refusal otherwise.
    Qwen3-Next-80B FP8 with 64 sessions of 32k does not fit one H200 (it ran out of memory there)."""
    argv = ["--model", "qwen3-next-80b-fp8", "--device", "meta", "--plan-only", "--memory-limit", "139GiB",
            "--batched-session", "64"]
    assert cli.run(args_for(*argv, "--max-ctx", "4096")) == 0
    out = capsys.readouterr().out
    assert "on meta" in out and "fits: yes" in out and "CUDA graphs of decode batches" in out
    assert cli.run(args_for(*argv, "--max-ctx", "32768")) == 2
    out = capsys.readouterr()
    assert "fits: NO" in out.out and "at most 62 session(s) fit" in out.err


def test_meta_is_for_plans_only():
    with pytest.raises(SystemExit, match="--device meta only plans"):
        cli.run(args_for("--device", "meta", "--port", "0"))
    with pytest.raises(SystemExit, match="--memory-limit"):
        cli.run(args_for("--device", "meta", "--plan-only"))


def _start(tmp_path, env=None):
    p, url, _ = cli.spawn(["--model", "tiny-qwen", "--batched-session", "1", "--max-ctx", "64", "--port", "0",
                           "--coalesce-us", "0", "--kv-cache-dir", str(tmp_path)], env=env)
    return p, url


def _complete(url, prompt, n):
    async def main():
        async with aiohttp.ClientSession() as s:
            st, j = await post(s, url + "/v1/completions", {"prompt": prompt, "max_tokens": n, "temperature": 0,
                                                            "return_token_ids": True})
            async with s.get(url + "/health") as r:
                return st, j, await r.json()
    return run(main())


def test_server_killed_while_writing_a_state_restarts_clean(model, tmp_path):
    a, b = [30, 31, 32, 33], [50, 51, 52]
    ref_a = greedy_ref(model, a, 2)[0]
    cont = a + ref_a + [9]
    ref_cont = greedy_ref(model, cont, 2)[0]
    p, url = _start(tmp_path, {"DS4T_SERVE_FAULT_SLOW_WRITE": "120"})  # writes pause half-way
    try:
        st, j, _ = _complete(url, a, 2)
        assert st == 200 and j["choices"][0]["token_ids"] == ref_a
        st, _, _ = _complete(url, b, 1)  # evicts a: its state is being written...
        assert st == 200
        deadline = time.time() + 60
        while not any(f.startswith(".tmp-") for f in os.listdir(tmp_path)):
            assert time.time() < deadline, os.listdir(tmp_path)
            time.sleep(0.05)
    finally:
        p.send_signal(signal.SIGKILL)  # ...when the server dies
        p.wait()
    assert not [f for f in os.listdir(tmp_path) if f.endswith(SUFFIX)]
    p, url = _start(tmp_path)
    try:
        st, j, health = _complete(url, cont, 2)
        assert st == 200 and j["choices"][0]["token_ids"] == ref_cont
        assert j["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # prefilled again, nothing half-written used
        kv = health["kv_cache"]
        assert kv["temp_removed"] == 1 and kv["restored"] == 0 and kv["corrupt"] == 0
    finally:
        p.send_signal(signal.SIGTERM)  # a clean stop saves the idle slot's state
        assert p.wait(60) == 0
    assert len([f for f in os.listdir(tmp_path) if f.endswith(SUFFIX)]) == 1


@pytest.mark.parametrize("damage", ["bit flip", "truncate"])
def test_corrupt_saved_state_is_reported_and_reprefilled(model, tmp_path, damage):
    a = [60, 61, 62]
    ref_a = greedy_ref(model, a, 2)[0]
    cont = a + ref_a + [5]
    ref_cont = greedy_ref(model, cont, 2)[0]
    srv = Server(model, slots=1, max_ctx=64, coalesce_us=0, kv_cache_dir=str(tmp_path))
    srv.start_in_thread()
    try:
        st, j, _ = _complete(srv.url, a, 2)
        assert j["choices"][0]["token_ids"] == ref_a
    finally:
        srv.stop_thread()  # saves a's state
    [name] = [f for f in os.listdir(tmp_path) if f.endswith(SUFFIX)]
    path = os.path.join(tmp_path, name)
    data = bytearray(open(path, "rb").read())
    if damage == "bit flip":
        data[-3] ^= 0x10
    else:
        data = data[: len(data) - 10]
    open(path, "wb").write(bytes(data))
    srv = Server(model, slots=1, max_ctx=64, coalesce_us=0, kv_cache_dir=str(tmp_path))
    srv.start_in_thread()
    try:
        st, j, health = _complete(srv.url, cont, 2)
        async def metrics():
            async with aiohttp.ClientSession() as s, s.get(srv.url + "/metrics") as r:
                return await r.text()
        text = run(metrics())
    finally:
        srv.stop_thread()
    assert st == 200 and j["choices"][0]["token_ids"] == ref_cont
    assert j["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert health["kv_cache"]["corrupt"] == 1 and "ds4t_serve_kv_corrupt_total 1" in text
    assert os.path.exists(path + ".corrupt")


@pytest.mark.parametrize("argv,option", [
    (["--max-ctx", "0"], "--max-ctx"),
    (["--prefill-chunk", "0"], "--prefill-chunk"),
    (["--memory-limit", "lots"], "--memory-limit"),
    (["--dtype", "int8"], "--dtype"),
    (["--max-waiting", "-1"], "--max-waiting"),
    (["--batched-session", "0"], "--batched-session"),
    (["--drain-timeout", "soon"], "--drain-timeout"),
    (["--kv-cache-dir", __file__], "--kv-cache-dir"),
    (["--port", "99999"], "--port: expected an integer in [0, 65535]"),
] + ([] if torch.cuda.is_available() else [(["--device", "cuda"], "--device")]))
def test_bad_cli_values_are_one_line_errors(argv, option, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and option in err and "Traceback" not in err, err


def test_a_kv_cache_dir_held_by_another_server_is_a_one_line_error(model, tmp_path):
    from ds4t.serve.persistence import KVStore

    holder = KVStore(str(tmp_path), "fp")
    try:
        with pytest.raises(SystemExit, match="in use by another ds4t server"):
            cli.build(args_for("--kv-cache-dir", str(tmp_path)), model=model)
    finally:
        holder.close()


_BROKEN_SERVER = """
import sys
import ds4t.serve.worker as worker

def broken(items, mode="auto"):
    raise RuntimeError("planted: the device is lost")

worker.eval_batch = broken
from ds4t.serve import cli
sys.exit(cli.main(sys.argv[1:]))
"""


def test_a_worker_that_cannot_go_on_exits_the_process_nonzero():
    p, url, _ = cli.spawn(["--model", "tiny-qwen", "--max-ctx", "64", "--port", "0", "--coalesce-us", "0"],
                          program=("-c", _BROKEN_SERVER))
    try:
        statuses = []

        async def main():
            async with aiohttp.ClientSession() as s:
                for _ in range(3):
                    statuses.append((await post(s, url + "/v1/completions", {"prompt": "hi", "max_tokens": 1}))[0])
        run(main())
        rc = p.wait(60)
    finally:
        p.kill()
    assert statuses == [500, 500, 500] and rc == 70


def test_sigterm_drains_then_ends_open_streams_with_an_error_and_done():
    # steps >= 70 ms on any device: the 60-token stream cannot finish within the 3 s drain, the 3-token one can
    p, url, _ = cli.spawn(["--model", "tiny-qwen", "--batched-session", "2", "--max-ctx", "64", "--port", "0",
                           "--coalesce-us", "0", "--drain-timeout", "3"], program=slow_server_program(0.07))
    try:
        async def main():
            async with aiohttp.ClientSession() as s:
                async def stream(n):
                    body = {"prompt": [1, 2], "max_tokens": n, "temperature": 0, "stream": True}
                    async with s.post(url + "/v1/completions", json=body) as r:
                        return await stream_events(r)
                short, long = asyncio.ensure_future(stream(3)), asyncio.ensure_future(stream(60))
                for _ in range(1200):
                    async with s.get(url + "/health") as r:
                        if (await r.json())["busy"] == 2:
                            break
                    await asyncio.sleep(0.05)
                p.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.3)
                refused = await post(s, url + "/v1/completions", {"prompt": "x", "max_tokens": 1})
                return await short, await long, refused
        short, long, refused = run(main())
        rc = p.wait(60)
    finally:
        p.kill()
    assert short[-1] == "[DONE]" and short[-2]["choices"][0]["finish_reason"] == "length"  # finished in the drain
    assert long[-1] == "[DONE]" and "error" in long[-2] and "shutting down" in long[-2]["error"]["message"]
    assert refused[0] == 503 and rc == 0


def test_a_checkpoint_file_is_served_under_its_base_name(model, tmp_path):
    f = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    f.write_bytes(b"")  # only the name matters here: the model is passed in
    server, _ = cli.build(args_for("--model", str(f)), model=model)
    try:
        assert server.model_id == "SmolLM2-135M-Instruct.Q4_1.gguf" and str(f) in server.aliases
    finally:
        server.pool.close()
        if server.store is not None:
            server.store.close()


def test_mtp_option_is_checked():
    import ds4t

    with pytest.raises(SystemExit, match="no MTP head"):
        cli.build(args_for("--model", "tiny-llama", "--mtp", "2"), model=ds4t.load("tiny-llama"))
    with pytest.raises(SystemExit):
        args_for("--mtp", "-1")
