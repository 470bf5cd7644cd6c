"""course.dist (lab 12's given code): the communicator, ranks as threads and as forked processes, the
tensor-parallel forward, pipeline stages, the disaggregated engine, and the torchrun entry point.

The tensor-parallel, pipeline and KV-transfer pieces the lab grades are written here again as small
references (the package never holds a graded answer), so that the given code around them is tested
on its own: a TP forward equals the model, stages compose to the model, disaggregated serving gives
the tokens of one engine. Tiny random models keep it fast; the real model runs only in the slow tests.
"""
from __future__ import annotations

import dataclasses
import os
import re
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from course.dist import CustomAllReduce, RankError, launch, run_threads
from course.dist.comm import Comm
from course.dist.disagg import ServeRequest, colocated_worker, disaggregated_worker, merge_logs
from course.dist.pipeline import Stage, stage_layers
from course.dist.tp import TPBlock, tp_forward, whole_block
from course.models import Decoder, ModelConfig, init_weights
from course.models.decoder import apply_rope
from course.tolerance import assert_orders_close, for_decoder, order_tol

LLAMA = ModelConfig(family="llama", vocab_size=61, n_layer=3, n_head=4, n_kv_head=2, d_model=32, d_ff=48, max_seq_len=64)
GPT2 = ModelConfig(family="gpt2", vocab_size=61, n_layer=2, n_head=4, n_kv_head=4, d_model=32, d_ff=64, max_seq_len=64)


def tiny(cfg=LLAMA, seed=1):
    return init_weights(Decoder(cfg), std=0.3, seed=seed).eval()


def greedy(model, prompt, n):
    """Reference: new tokens of `prompt`, no cache, the whole sequence every step."""
    out = []
    with torch.no_grad():
        for _ in range(n):
            x = torch.tensor([prompt + out])
            out.append(int(model(x, torch.arange(x.shape[1])[None])[0, -1].argmax()))
    return out


# --- references of the lab's answers (for testing the given code around them) ----------------------

def _lin(w, b):
    lin = nn.Linear(w.shape[1], w.shape[0], bias=b is not None)
    with torch.no_grad():
        lin.weight.copy_(w)
        if b is not None:
            lin.bias.copy_(b)
    return lin


def ref_shard(block, cfg, r, w):
    def cols(lin):
        n = lin.out_features // w
        return _lin(lin.weight[r * n:(r + 1) * n], None if lin.bias is None else lin.bias[r * n:(r + 1) * n])

    def rows(lin):
        n = lin.in_features // w
        return _lin(lin.weight[:, r * n:(r + 1) * n], lin.bias if (lin.bias is not None and r == 0) else None)

    llama = cfg.family == "llama"
    a, m = block.attn, block.mlp
    return TPBlock(r, w, cfg.family, cfg.n_head // w, cfg.n_kv_head // w, cfg.head_dim, block.attn_norm, block.mlp_norm,
                   cols(a.q_proj), cols(a.k_proj), cols(a.v_proj), rows(a.o_proj), cols(m.up_proj if llama else m.fc),
                   rows(m.down_proj if llama else m.proj), cols(m.gate_proj) if llama else None)


def ref_attention(h, s, rope, comm):
    B, T, _ = h.shape
    q = s.q(h).view(B, T, s.n_head, s.head_dim).transpose(1, 2)
    k = s.k(h).view(B, T, s.n_kv_head, s.head_dim).transpose(1, 2)
    v = s.v(h).view(B, T, s.n_kv_head, s.head_dim).transpose(1, 2)
    if rope is not None:
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    g = s.n_head // s.n_kv_head
    y = F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), is_causal=True)
    return comm.all_reduce(s.o(y.transpose(1, 2).reshape(B, T, -1)))


def ref_mlp(h, s, comm):
    a = F.silu(s.gate(h)) * s.up(h) if s.gate is not None else F.gelu(s.up(h), approximate="tanh")
    return comm.all_reduce(s.down(a))


def ref_send_kv(comm, dst, cache, table, n_tokens, first_token):
    header = torch.tensor([n_tokens, first_token, len(table)])
    k, v = cache.k[:, table].contiguous(), cache.v[:, table].contiguous()
    for t in (header, k, v):
        comm.send(t, dst)
    return header.nbytes + k.nbytes + v.nbytes


def ref_recv_kv(comm, src, cache, alloc, seq):
    header = comm.recv(torch.empty(3, dtype=torch.long), src)
    n, first, nb = header.tolist()
    alloc.append(seq, n)
    shape = (cache.k.shape[0], nb, *cache.k.shape[2:])
    k, v = comm.recv(torch.empty(shape), src), comm.recv(torch.empty(shape), src)
    cache.k[:, alloc.block_tables[seq]] = k
    cache.v[:, alloc.block_tables[seq]] = v
    return n, first


# --- the communicator and ranks as threads -----------------------------------------------------------

def test_thread_all_reduce_sums_identically_and_counts():
    def fn(comm):
        x = torch.full((2, 3), float(comm.rank + 1))
        comm.all_reduce(x)
        return x, comm.stats.all_reduce_calls, comm.stats.all_reduce_bytes, comm.stats.log

    out = run_threads(fn, 4)
    for x, calls, nbytes, log in out:
        assert torch.equal(x, torch.full((2, 3), 10.0)) and calls == 1 and nbytes == 24 and log == [("all_reduce", (2, 3))]


def test_thread_send_recv_in_order_with_isend_and_counter():
    def fn(comm):
        if comm.rank == 0:
            comm.counter("done", 1)           # before the sends: rank 1 reads it after its receives, never too early
            works = [comm.isend(torch.tensor([float(i)]), 1) for i in range(3)]
            for w in works:
                w.wait()
            return comm.stats.sends, comm.stats.bytes_sent
        got = [comm.recv(torch.empty(1), 0).item() for _ in range(3)]
        return got, comm.counter("done")

    (sends, sent), (got, done) = run_threads(fn, 2)
    assert (sends, sent, got, done) == (3, 12, [0.0, 1.0, 2.0], 1)


MISTAKES = {   # what a rank does wrong -> what the error must say
    "deadlock": lambda comm: (comm.send(torch.zeros(2), 1 - comm.rank), comm.recv(torch.zeros(2), 1 - comm.rank)),
    "same shape": lambda comm: comm.all_reduce(torch.zeros(2 + comm.rank)),
    "different collectives": lambda comm: comm.all_reduce(torch.zeros(2)) if comm.rank else comm.barrier(),
    "already returned": lambda comm: comm.recv(torch.zeros(2), 1) if comm.rank == 0 else None,
    "send the sizes first": lambda comm: comm.send(torch.zeros(3), 1) if comm.rank == 0 else comm.recv(torch.zeros(2), 0),
    "must be a torch.Tensor": lambda comm: comm.send([1, 2], 1 - comm.rank),
    "contiguous": lambda comm: comm.send(torch.zeros(4, 4).t(), 1 - comm.rank),
    "another rank": lambda comm: comm.send(torch.zeros(2), comm.rank),
}


@pytest.mark.parametrize("match", list(MISTAKES))
def test_thread_mistakes_are_named_not_hung(match):
    start = time.monotonic()
    with pytest.raises((RuntimeError, ValueError, TypeError), match=match):
        run_threads(MISTAKES[match], 2, timeout=10)
    assert time.monotonic() - start < 5


def test_thread_error_keeps_its_type_and_names_its_rank():
    def fn(comm):
        if comm.rank == 1:
            raise NotImplementedError
        comm.barrier()

    with pytest.raises(NotImplementedError) as info:
        run_threads(fn, 3)
    assert "rank 1 of 3" in "".join(getattr(info.value, "__notes__", []))


def test_bad_arguments():
    with pytest.raises(ValueError, match="world_size"):
        run_threads(lambda comm: None, 0)
    with pytest.raises(TypeError, match="fn"):
        launch("not a function", 2)
    with pytest.raises(ValueError, match="world_size"):
        launch(lambda comm: None, 99)
    with pytest.raises(ValueError, match="rank"):
        Comm(3, 2)
    with pytest.raises(ValueError, match="key"):
        run_threads(lambda comm: comm.counter(""), 1)


def test_custom_all_reduce_routes_through_the_inner_comm():
    def naive(x, comm):             # everyone sends everything to everyone
        works = [comm.isend(x.clone(), p) for p in range(comm.world_size) if p != comm.rank]
        total = x.clone()
        for p in range(comm.world_size):
            if p != comm.rank:
                total += comm.recv(torch.empty_like(x), p)
        for w in works:
            w.wait()
        x.copy_(total)

    def fn(comm):
        c = CustomAllReduce(comm, naive)
        x = torch.ones(4) * (comm.rank + 1)
        c.all_reduce(x)
        return x, comm.stats.bytes_sent, c.stats.all_reduce_calls

    for x, sent, calls in run_threads(fn, 3):
        assert torch.equal(x, torch.full((4,), 6.0)) and sent == 2 * 16 and calls == 1


# --- ranks as processes ------------------------------------------------------------------------------

_before: set[int] = set()     # this process's children when the test started (another test's browser driver)


@pytest.fixture(autouse=True)
def _children_before():
    _before.clear()
    _before.update(_all_children())


def _all_children() -> list[int]:
    me = os.getpid()
    found = []
    for task in os.listdir(f"/proc/{me}/task"):
        try:
            found += [int(p) for p in open(f"/proc/{me}/task/{task}/children").read().split()]
        except OSError:
            pass
    return found


def _children() -> list[int]:
    """This process's children that the running test started and left (a rank not reaped)."""
    return [p for p in _all_children() if p not in _before]


def test_launch_runs_processes_and_returns_in_rank_order(capsys):
    def fn(comm, base):
        x = torch.tensor([float(comm.rank)])
        comm.all_reduce(x)
        print("hello", comm.rank)
        return base + comm.rank, x.item(), os.getpid(), comm.backend

    out = launch(fn, 3, 10, timeout=60)
    assert [o[0] for o in out] == [10, 11, 12] and all(o[1] == 3.0 for o in out)
    assert len({o[2] for o in out} | {os.getpid()}) == 4 and out[0][3] == "gloo"
    assert "[rank 2] hello 2" in capsys.readouterr().out
    assert _children() == [], "every rank is reaped"


def test_launch_reports_a_rank_error_and_stops_the_others():
    def fn(comm):
        if comm.rank == 1:
            raise ValueError("boom in rank one")
        comm.barrier()                  # rank 0 would wait forever

    start = time.monotonic()
    with pytest.raises(RankError, match=r"rank 1 of 2 raised ValueError: boom in rank one(.|\n)*fn"):
        launch(fn, 2, timeout=60)
    assert time.monotonic() - start < 30 and _children() == []


def test_launch_timeout_and_a_dying_rank_leave_nothing_running():
    def stuck(comm):
        comm.send(torch.zeros(2), 1 - comm.rank)      # both send first: a deadlock

    with pytest.raises(TimeoutError, match="deadlock"):
        launch(stuck, 2, timeout=3)
    assert _children() == []

    def dies(comm):
        if comm.rank == 0:
            os._exit(3)
        return 1

    with pytest.raises(RankError, match="died"):
        launch(dies, 2, timeout=30)
    assert _children() == []


def test_an_interrupted_launch_stops_its_ranks():
    """A KeyboardInterrupt in the caller (Jupyter's stop button, the grader's cell timeout) while the ranks run."""
    import signal

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 1.0)
    try:
        with pytest.raises(KeyboardInterrupt):
            launch(lambda comm: time.sleep(60), 2, timeout=120)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert _children() == []


# --- tensor parallelism --------------------------------------------------------------------------------

@pytest.mark.parametrize("cfg, world", [(LLAMA, 1), (LLAMA, 2), (GPT2, 2), (GPT2, 4)])
def test_tp_forward_equals_the_model(cfg, world):
    model = tiny(cfg)
    ids = torch.randint(0, 61, (2, 6), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(6)[None].expand(2, 6)
    with torch.no_grad():
        want = model(ids, pos)

    def fn(comm):
        shards = [ref_shard(b, cfg, comm.rank, comm.world_size) for b in model.blocks]
        return tp_forward(model, shards, ids, pos, comm, attention=ref_attention, mlp=ref_mlp), comm.stats.all_reduce_calls

    for logits, calls in run_threads(fn, world):
        # sharded matmuls summed by all-reduce: the model's sums in another order
        assert_orders_close(logits, want, **for_decoder(cfg), what=f"{world} ranks")
        assert calls == 2 * cfg.n_layer


def test_whole_block_is_the_block_and_tp_forward_checks_its_shards():
    model = tiny()
    s = whole_block(model.blocks[0], model.cfg)
    assert s.q is model.blocks[0].attn.q_proj and s.n_head == 4 and s.parameter_bytes() > 0
    ids, pos = torch.zeros(1, 3, dtype=torch.long), torch.arange(3)[None]
    with pytest.raises(ValueError, match="one per layer"):
        run_threads(lambda comm: tp_forward(model, [s], ids, pos, comm, attention=ref_attention, mlp=ref_mlp), 1)
    with pytest.raises(ValueError, match="rank 0 of 1"):
        run_threads(lambda comm: tp_forward(model, [s] * 3, ids, pos, comm, attention=ref_attention, mlp=ref_mlp), 2)


# --- pipeline stages -------------------------------------------------------------------------------------

def test_stage_layers_split_evenly_and_stages_compose_to_the_model():
    assert stage_layers(30, 4) == [range(0, 8), range(8, 16), range(16, 23), range(23, 30)]
    with pytest.raises(ValueError, match="n_stages"):
        stage_layers(3, 4)
    for cfg in (LLAMA, GPT2):
        model = tiny(cfg)
        ids = torch.randint(0, 61, (2, 5), generator=torch.Generator().manual_seed(1))
        pos = torch.arange(5)[None].expand(2, 5)
        x = ids
        stages = [Stage(model, s, cfg.n_layer) for s in range(cfg.n_layer)]
        for st in stages:
            x = st(x, pos)
        with torch.no_grad():
            assert_orders_close(x, model(ids, pos)[:, -1], **for_decoder(cfg))   # the head on one row, not all
        total = sum(p.nbytes for p in model.parameters())
        tied_twice = model.embed.weight.nbytes       # the tied embedding: on the first stage and, as the head, on the last
        assert sum(st.parameter_bytes() for st in stages) == total + tied_twice


# --- disaggregated serving ----------------------------------------------------------------------------

def _requests(n=4, new=5):
    g = torch.Generator().manual_seed(3)
    return [ServeRequest(i, torch.randint(1, 61, (5 + 3 * i,), generator=g).tolist(), new, arrival=0.01 * i)
            for i in range(n)]


def test_colocated_and_disaggregated_give_the_tokens_of_one_engine():
    model = tiny()
    want = {r.rid: greedy(model, r.prompt, r.max_new_tokens) for r in _requests()}
    for runner in (run_threads, launch):
        one = merge_logs(runner(colocated_worker, 1, model, _requests(), 32, 4))[0]
        two = merge_logs(runner(colocated_worker, 2, model, _requests(), 32, 4))[0]
        logs = runner(disaggregated_worker, 2, model, _requests(), 32, 4, send_kv=ref_send_kv, recv_kv=ref_recv_kv)
        split, times = merge_logs(logs)
        assert one == two == split == want, runner.__name__
        assert all(len(times[r]) == 5 and times[r] == sorted(times[r]) for r in want)
        sender = next(g for g in logs if g.role == "prefill")
        assert [rid for rid, _, _ in sender.transfers] == [0, 1, 2, 3]
        block = LLAMA.n_layer * 4 * LLAMA.n_kv_head * LLAMA.head_dim * 4          # K (or V) of one block, float32
        assert all(b == 24 + 2 * block * -(-len(r.prompt) // 4) for (_, b, _), r in zip(sender.transfers, _requests())), \
            "header + K and V of the prompt's blocks"


def test_serving_checks_its_input_and_reports_a_failing_transfer():
    model = tiny()
    with pytest.raises(ValueError, match="blocks"):
        run_threads(colocated_worker, 1, model, _requests(), 2, 4)
    with pytest.raises(ValueError, match="2 ranks"):
        run_threads(disaggregated_worker, 3, model, _requests(), send_kv=ref_send_kv, recv_kv=ref_recv_kv)

    def broken(comm, dst, cache, table, n_tokens, first_token):
        raise NotImplementedError

    with pytest.raises(NotImplementedError):
        run_threads(disaggregated_worker, 2, model, _requests(), 32, 4, send_kv=broken, recv_kv=ref_recv_kv)


# --- torchrun ---------------------------------------------------------------------------------------------

def _answers_file(path):
    """A file as write_answers makes it, holding this module's references under the lab's names."""
    from course.dist.torchrun_tp import write_answers

    write_answers(path, [_lin, ref_shard, ref_attention, ref_mlp])
    with open(path, "a") as f:
        f.write("\nshard_block, tp_attention, tp_mlp = ref_shard, ref_attention, ref_mlp\n")
    return path


_SCALE = torch.tensor(2.0)


def _scaled_mlp(h, shard, comm):        # reads a tensor of this module as a global: no file can hold it
    return ref_mlp(h, shard, comm) * _SCALE


def _whole_then_ref(block, cfg, r, w):  # calls the course's whole_block and a helper of this module
    assert whole_block(block, cfg).n_head == cfg.n_head
    return ref_shard(block, cfg, r, w)


def test_write_answers_brings_helpers_and_names_what_a_file_cannot_hold(tmp_path):
    from course.dist.torchrun_tp import import_answers, load_answers, write_answers

    path = write_answers(tmp_path / "a.py", [ref_attention, ref_mlp])
    assert "def ref_attention" in path.read_text() and "import torch" in path.read_text()
    with pytest.raises(AttributeError, match="shard_block"):
        load_answers(path)
    text = write_answers(tmp_path / "b.py", [_whole_then_ref]).read_text()   # helpers come along: ref_shard, _lin
    assert "def ref_shard" in text and "def _lin" in text and "from course.dist.tp import whole_block" in text
    moved = import_answers(tmp_path / "b.py")._whole_then_ref(Decoder(LLAMA).blocks[0], LLAMA, 0, 2)
    assert type(moved) is TPBlock and moved.n_head == 2, "the file runs on its own, in a fresh namespace"
    with pytest.raises(ValueError, match="_SCALE"):
        write_answers(tmp_path / "c.py", [_scaled_mlp])
    module = load_answers(_answers_file(tmp_path / "d.py"))
    assert module.shard_block.__name__ == "ref_shard"


_USER = """
import pathlib, sys, time
from course.dist.torchrun_tp import answers_file, import_answers

def shard_block(block, cfg, rank, world):
    return "{user}"

path = answers_file([shard_block])            # lab 12's section 8 writes the answers the same way
meeting = pathlib.Path(sys.argv[1])
(meeting / "{user}").write_text(str(path))
while len(list(meeting.iterdir())) < 2:       # both have written before either runs
    time.sleep(0.05)
print(import_answers(path).shard_block(None, None, 0, 1), path)
"""


def test_two_students_on_one_machine_each_run_their_own_answers(tmp_path):
    """Two students on one server (a Littlest JupyterHub: one /tmp for all) write their answers for
    torchrun at the same moment: each gets a folder of their own, and each runs their own file."""
    import subprocess

    shared_tmp, meeting = tmp_path / "tmp", tmp_path / "meeting"
    shared_tmp.mkdir()
    meeting.mkdir()
    procs = {}
    for user in ("ann", "ben"):
        home = tmp_path / user
        home.mkdir()
        (home / "run.py").write_text(_USER.format(user=user))
        env = {**os.environ, "TMPDIR": str(shared_tmp), "HOME": str(home)}
        procs[user] = subprocess.Popen([sys.executable, str(home / "run.py"), str(meeting)], env=env, cwd=home,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ran = {}
    for user, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]
        ran[user] = out.split()
    assert {u: r[0] for u, r in ran.items()} == {"ann": "ann", "ben": "ben"}, f"a student ran another's answers: {ran}"
    folders = {u: Path(r[1]).parent for u, r in ran.items()}
    assert folders["ann"] != folders["ben"] and all(f.parent == shared_tmp for f in folders.values())
    assert all(f.stat().st_mode & 0o077 == 0 for f in folders.values()), "each folder is its owner's alone (0700)"


@pytest.mark.slow
def test_torchrun_three_ranks(tmp_path):
    """`torchrun --nproc-per-node=3 -m course.dist.torchrun_tp` with gloo: the real launcher, the real model."""
    import subprocess

    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=3", "-m",
                           "course.dist.torchrun_tp", "--answers", str(_answers_file(tmp_path / "answers.py")),
                           "--repeats", "1"],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "3 ranks, backend gloo" in done.stdout, done.stdout
    diff, largest = map(float, re.search(r"single device\| = (\S+) \(largest logit (\S+)\)", done.stdout).groups())
    # SmolLM2-135M's sums split over 3 ranks and added by all-reduce: the budget of two orders for its widest
    # reduction (d_ff 1536) and 30 layers + the head, at the scale of its largest logit
    assert diff <= order_tol(torch.tensor([largest]), terms=1536, stages=31)["atol"], done.stdout


def test_lab12_phase_times_has_blocks_for_every_mode():
    """Lab 12's prefill/decode timing cell sizes its block pool for its prompt and repeats. On a GPU in
    full mode (256-token prompts, 3 repeats) a fixed pool of 64 blocks ran out; every mode's sizes must fit."""
    from autograder.lab_builders.lab12_disagg import CELLS
    from course.dist.disagg import Engine
    from course.timing import benchmark

    source = next(c.source for c in CELLS if "def phase_times" in c.source)
    source = source[source.index("def phase_times"):source.index("PREFILL_S, DECODE_S =")]
    scope = {"Engine": Engine, "benchmark": benchmark}
    exec(source, scope)
    model = tiny(dataclasses.replace(LLAMA, max_seq_len=300))
    for p_len, repeats in ((256, 3), (128, 3), (64, 1)):               # GPU full, CPU full, quick (env.pick in the cell)
        prefill_s, decode_s = scope["phase_times"](None, model, (list(range(1, 61)) * 5)[:p_len], repeats)
        assert prefill_s > 0 and decode_s > 0
