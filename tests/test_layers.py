"""The decoder layers' runtime (layers.py): compiled layers compute what eager ones do and stay compiled
through the trainer's calls, a fallback is counted and said, the checkpointing modes give the same gradients."""
import contextlib

import pytest
import torch

import layers
import metrics
import parallel
import policy as policies
import stapo
from support import (args_for, load_params, assert_same_params, run, assert_same_metrics, metrics_of,
                     one_step_on_four_prompts, Matmuls)


def test_compiled_layers_compute_what_the_eager_layers_do(tiny):
    """layers.compile_layers (stapo.py --compile-layers; auto: on CUDA) against the eager layers, on the same
    weights and samples: log p of every response token and every parameter's gradient, over two micro-batches
    of different shapes (the dynamic-shape graph), with FSDP2 and checkpointing as the trainer builds them.
    On a GPU (benchmarks/gpu_check.py runs this test there) the backend is inductor, in fp32 and bf16; on CPU,
    aot_eager in fp32: dynamo's capture, the FSDP2 hooks it skips and AOT autograd are ours to prove, while
    inductor's CPU kernels, which no GPU runs, cost a minute of compiling. Tolerances, the largest gap over
    log p and gradients against the fp32 eager result: fp32, 1e-5 of the largest value (reordered sums);
    bf16, at most twice the bf16 eager layers' own gap (a fused chain kept in fp32 is closer to fp32).
    Breaks if compile_layers compiles nothing (no graph), renames the parameters (torch.compile(layer) wraps
    it: _orig_mod., which checkpoints and syncs would not find), or computes something else."""
    from torch._dynamo.utils import counters
    d, _ = tiny
    rank, world, device, mesh = parallel.init_distributed()
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    g = torch.Generator().manual_seed(0)
    rows = [(torch.randint(100, (p,), generator=g).tolist(), torch.randint(100, (r,), generator=g).tolist())
            for p, r in ((3, 4), (5, 2), (2, 7), (4, 3), (6, 9))]
    valid = (torch.arange(9) < torch.tensor([len(r) for _, r in rows])[:, None]).to(device)

    def run(policy):
        policy.zero_grad(set_to_none=True)
        out = []
        for idx in ([0, 1, 2], [3, 4]):  # [3, 9] then [2, 15]: a second shape
            logp = policies.response_logprobs(policy, rows, idx, valid, 1.0).logp
            (logp * valid[idx]).sum().backward()
            out.append(logp.detach().float().flatten())
        return torch.cat(out + [p.grad.full_tensor().float().flatten() for p in policy.parameters()])

    def both(dtype):  # (eager, compiled) on one policy
        policy = policies.build_policy(str(d / "model"), mesh, device, dtype)
        names, graphs = [n for n, _ in policy.named_parameters()], counters["stats"]["unique_graphs"]
        eager = run(policy)
        layers.compile_layers(policy.lm, policy.layers, backend)
        try:
            assert [n for n, _ in policy.named_parameters()] == names
            compiled = run(policy)
            assert counters["stats"]["unique_graphs"] > graphs  # something was compiled
        finally:
            layers.eager_layers(policy.lm, policy.layers)
        return eager, compiled

    try:
        ref, fp32 = both(torch.float32)
        gap = lambda x: (x - ref).abs().max().item() / ref.abs().max().item()  # noqa: E731
        print(f"compiled layers ({backend}): fp32, gap {gap(fp32):.2e} of the largest value")
        assert gap(fp32) <= 1e-5
        if device.type == "cuda":  # on CPU, aot_eager runs bf16 through the same aten ops as eager
            eager16, compiled16 = both(torch.bfloat16)
            print(f"bf16: gap {gap(compiled16):.2e}, the eager bf16 layers' {gap(eager16):.2e}")
            assert gap(compiled16) <= 2 * gap(eager16)
    finally:
        torch._dynamo.reset()


def layer_cache_entries():
    """The compiled variants the decoder layers hold: dynamo's cache entries on run_layer's code, which every
    layer shares, and which its recompile limit counts."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    return len(_debug_get_cache_entry_list(layers.run_layer.__code__))


def trainers_call_pattern(policy, opt, args, device, hidden, steps=3):
    """What stapo.py's steps ask of the policy, on made-up rows: the old pass (no grad) and the updates
    (forward, backward under checkpointing, a micro-batch of one sample among them) of two mini-batches of
    varied lengths, and the sync's probe (no grad, one row). Step 0's first micro-batch is one sample padded
    to exactly the hidden size (dynamo's duck sizing pins a length first compiled equal to another size)."""
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        rows = [(torch.randint(100, (p,), generator=g).tolist(), torch.randint(100, (r,), generator=g).tolist())
                for p, r in zip(torch.randint(5, 30, (16,), generator=g).tolist(),
                                torch.randint(1, 30, (16,), generator=g).tolist())]
        if step == 0:
            rows[0] = (rows[0][0][:5] + [1] * (hidden - 5 - 20), [2] * 20)  # 64 tokens: alone in its micro-batch
        lengths = torch.tensor([len(r) for _, r in rows])
        valid = (torch.arange(int(lengths.max())) < lengths[:, None]).to(device)
        blocks = [sorted(range(b * 8, b * 8 + 8), key=lambda i: len(rows[i][0]) + len(rows[i][1])) for b in (0, 1)]
        if step == 0:
            assert len(rows[blocks[0][-1]][0]) + len(rows[blocks[0][-1]][1]) <= hidden or blocks[0][0] == 0
        old = [stapo.token_stats(policy, rows, idx, valid, args.micro_tokens, 1.0) for idx in blocks]
        for idx, o in zip(blocks, old):
            adv = torch.linspace(-1, 1, len(idx), device=device)
            mb = stapo.MiniBatch(idx, o.logp, adv, valid[idx].float(), float(valid[idx].sum()))
            stapo.update(policy, opt, rows, valid, mb, args, metrics.StepMetrics(step, "stapo"))
        with torch.no_grad():
            probe = [(rows[0][0], rows[0][1] + rows[1][1])]
            policies.response_logprobs(policy, probe, [0], torch.ones(1, len(probe[0][1]), dtype=torch.bool), 1.0)


@pytest.mark.slow
def test_compiled_layers_stay_compiled_through_the_trainers_call_pattern(tiny, tmp_path):
    """Every decoder-layer call of three steps of the trainer's passes (trainers_call_pattern: the old pass,
    updates with their backward and checkpoint recompute, one-sample micro-batches, the probe, varied lengths,
    a first micro-batch padded to the hidden size) runs compiled: none is counted eager (run_layer counts the
    calls that run outside a compiled graph, as when dynamo's recompile limit is hit), and the variants the
    layers compile stay well under layers.RECOMPILE_LIMIT. Breaks if a variant of the pattern recompiles on
    every new length, or if the variants outgrow torch's default limit of 8 again (HF's checkpointing, a hook
    that makes layer 0's input require grad under no_grad, and the recompute's own entries made exactly 8)."""
    args, policy, opt, device, *_ = one_step_on_four_prompts(tiny, tmp_path, "--micro-tokens", "64")
    torch._dynamo.reset()
    layers.compile_layers(policy.lm, policy.layers, "aot_eager")  # AOT autograd, as inductor runs it, minus it
    try:
        before = policy.layers.eager_calls
        trainers_call_pattern(policy, opt, args, device, policy.lm.config.hidden_size)
        eager, variants = policy.layers.eager_calls - before, layer_cache_entries()
        print(f"compiled layers: {variants} variants over 3 steps; {eager} layer calls eager")
        assert eager == 0 and 0 < variants <= 4 < layers.RECOMPILE_LIMIT  # grad on, off; one sample, more
    finally:
        layers.eager_layers(policy.lm, policy.layers)
        torch._dynamo.reset()


@pytest.mark.slow
def test_layer_calls_that_run_eager_although_compiled_are_counted_and_said(tiny, tmp_path, monkeypatch, capsys):
    """A run whose compiled layers hit the recompile limit (1 here) counts each layer call that ran eager in its
    metrics row (eager_layer_calls) and says so in one line with the step; one whose compiler fails on every
    graph runs them eager, warns once naming --compile-layers off, trains on, and counts those calls too; a
    run of eager layers (--compile-layers off) has no such key. Breaks with a silent fallback (dynamo's own
    is one log line), a failed graph's calls left uncounted, or a count that a compiled call also moves."""
    d, _ = tiny
    real = layers.compile_layers
    torch._dynamo.reset()
    monkeypatch.setattr(policies, "compile_layers", lambda lm, runtime: real(lm, runtime, "aot_eager"))
    monkeypatch.setattr(layers, "RECOMPILE_LIMIT", 1)
    try:
        with torch._dynamo.config.patch(recompile_limit=1):  # (a monkeypatch of dynamo's config deletes it)
            stapo.train(stapo.get_args(args_for(d, tmp_path / "limit", "--steps", "2", "--compile-layers", "on")))
        rows = metrics_of(tmp_path / "limit")
        assert all(x["eager_layer_calls"] > 0 for x in rows), rows
        said = [line for line in capsys.readouterr().err.splitlines() if "decoder-layer calls ran eager" in line]
        assert len(said) == 2 and "step 1: " in said[0] and "--compile-layers off" in said[0]  # after tqdm's bar
        torch._dynamo.reset()
        monkeypatch.setattr(layers, "RECOMPILE_LIMIT", 64)

        def broken(graph, example_inputs):
            raise RuntimeError("no C++ compiler here")
        monkeypatch.setattr(policies, "compile_layers", lambda lm, runtime: real(lm, runtime, broken))
        with pytest.warns(UserWarning, match=r"torch.compile of a decoder layer failed.*no C\+\+ compiler here.*"
                                             r"--compile-layers off runs every layer eager") as caught:
            policy = stapo.train(stapo.get_args(args_for(d, tmp_path / "broken", "--steps", "2",
                                                         "--compile-layers", "on")))
        assert len([w for w in caught if "decoder layer" in str(w.message)]) == 1 and policy.layers.failures
        rows = metrics_of(tmp_path / "broken")
        assert all(x["grad_norm"] > 0 and x["eager_layer_calls"] > 0 for x in rows), rows
    finally:
        torch._dynamo.reset()
    stapo.train(stapo.get_args(args_for(d, tmp_path / "eager", "--steps", "1")))
    assert "eager_layer_calls" not in metrics_of(tmp_path / "eager")[0]


def test_a_failed_layer_compile_runs_eager_with_its_checkpoint_and_is_counted(tiny):
    """A compiler that fails on the layers' graph: the layers run eager from then on, each call counted in
    Layers.eager_calls, and their backward recomputes what full checkpointing dropped, as eager layers do (the
    same matmuls counted). Breaks if the fallback runs the traced graph instead (torch 2.11 runs that graph's
    checkpoint body without a checkpoint: the memory of --checkpointing off), or leaves its calls uncounted."""
    d, _ = tiny
    rank, world, device, mesh = parallel.init_distributed()
    rows = [([1, 2, 3], [4, 5, 6, 7]), ([1, 2], [3, 4])]
    valid = torch.arange(4) < torch.tensor([4, 2])[:, None]

    def backward_matmuls(policy):
        logp = policies.response_logprobs(policy, rows, [1, 0], valid, 1.0).logp
        with Matmuls() as seen:
            (logp * valid[[1, 0]]).sum().backward()
        return seen.count

    def broken(graph, example_inputs):
        raise RuntimeError("no C++ compiler here")
    eager = backward_matmuls(policies.build_policy(str(d / "model"), mesh, device))
    torch._dynamo.reset()
    try:
        policy = policies.build_policy(str(d / "model"), mesh, device)
        with pytest.warns(UserWarning, match="torch.compile of a decoder layer failed"):
            layers.compile_layers(policy.lm, policy.layers, broken)
            calls = policy.layers.eager_calls
            assert backward_matmuls(policy) == eager and policy.layers.failures
        assert policy.layers.eager_calls - calls == len(policy.lm.get_decoder().layers)
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_checkpointing_full_selective_and_off_give_the_same_gradients(tiny, compiled):
    """--checkpointing full, selective and off: the same log p and every parameter's gradient, bit for bit, eager
    and compiled (aot_eager: the checkpoint inside the compiled graph, as inductor takes it; its selective
    policy then goes to AOT autograd's partitioner). What differs is what the backward recomputes, counted in
    its matmuls (eager): full replays the forward's, selective recomputes none (it keeps the matmuls' and
    attention's outputs), off has nothing to recompute. Breaks if a mode is dropped on its way to the layers,
    or if selective keeps nothing (it would recompute as full does)."""
    d, _ = tiny
    rank, world, device, mesh = parallel.init_distributed()
    g = torch.Generator().manual_seed(0)
    rows = [(torch.randint(100, (p,), generator=g).tolist(), torch.randint(100, (r,), generator=g).tolist())
            for p, r in ((3, 4), (5, 2), (2, 7))]
    valid = torch.arange(7) < torch.tensor([len(r) for _, r in rows])[:, None]

    out = {}
    torch._dynamo.reset()
    try:
        for mode in ("full", "selective", "off"):
            policy = policies.build_policy(str(d / "model"), mesh, device, torch.float32, compiled, mode)
            if compiled:
                layers.compile_layers(policy.lm, policy.layers, "aot_eager")
            logp = policies.response_logprobs(policy, rows, [0, 1, 2], valid, 1.0).logp
            backward = Matmuls()
            with backward if not compiled else contextlib.nullcontext():  # a compiled backward is one graph
                (logp * valid).sum().backward()
            grads = [p.grad.full_tensor() for p in policy.parameters()]
            out[mode] = logp.detach(), grads, backward.count
    finally:
        torch._dynamo.reset()
    for mode in ("selective", "off"):
        assert torch.equal(out[mode][0], out["full"][0]), mode
        assert all(torch.equal(a, b) for a, b in zip(out[mode][1], out["full"][1])), mode
    if not compiled:
        assert out["selective"][2] == out["off"][2] < out["full"][2], {m: o[2] for m, o in out.items()}


@pytest.mark.parametrize("flags, want", [((), (False, "full")),
                                         (("--compile-layers", "on", "--no-checkpointing"), (True, "off")),
                                         (("--checkpointing", "selective"), (False, "selective"))])
def test_the_speed_flags_reach_the_policy(tiny, tmp_path, monkeypatch, flags, want):
    """--compile-layers (auto: on CUDA only, so off here) and --checkpointing (--no-checkpointing: off) reach
    policy.build_policy as (compiled, checkpointing). Breaks if either flag is dropped on its way, or if auto
    compiles on a CPU."""
    class Built(Exception):
        pass

    def build(path, mesh, device, dtype, compiled, checkpointing):
        raise Built(compiled, checkpointing)
    monkeypatch.setattr(stapo, "build_policy", build)
    with pytest.raises(Built) as seen:
        stapo.train(stapo.get_args(args_for(tiny[0], tmp_path, *flags)))
    assert seen.value.args == want


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_trainer_with_compiled_layers_trains_as_with_eager_ones(tiny, tmp_path, monkeypatch, one_thread, dtype):
    """stapo.train with its decoder layers compiled by inductor (what a GPU runs, lowered to C++ here), against
    eager layers. At lr 0 every mini-batch's ratio is exactly 1 in every micro-batch, in fp32 and bf16: the old
    pass's no-grad graphs and the update's training graphs compute the same log p (so here; docs/training.md:
    compiled layers). Trained a step of 4 updates at lr 1e-3, the model and every metric match eager layers':
    fp32, within assert_same_params' 2e-5 and 1e-4 of each metric (reordered sums); bf16, the same samples, the
    gradient norm within 5% and the model within 1e-2. No layer call runs eager.
    Breaks if compiled layers compute something else, if the old pass and the update disagree (a ratio off 1
    clips, and the loss is not the paper's), or if the layers fall back to eager."""
    d, _ = tiny
    seen, real_loss = [], stapo.stapo_loss

    def recording(logp, old_logp, adv, keep, *a, **k):
        seen.append((logp.detach().float() - old_logp.float())[keep > 0])
        return real_loss(logp, old_logp, adv, keep, *a, **k)
    monkeypatch.setattr(stapo, "stapo_loss", recording)
    common = ("--minibatches", "4", "--prompts-per-step", "8", "--micro-tokens", "40", "--dtype", dtype)
    torch._dynamo.reset()
    try:
        stapo.train(stapo.get_args(args_for(d, tmp_path / "lr0", "--steps", "1", "--lr", "0", "--compile-layers",
                                            "on", *common)))
        assert len(seen) >= 8 and all(torch.equal(x, torch.zeros_like(x)) for x in seen), [x.abs().max() for x in seen]
        m = metrics_of(tmp_path / "lr0")[0]
        print(f"compiled {dtype}: ratio 1 in {len(seen)} micro-batches; sync probe gap {m['sync_probe_gap_mean']:.2e} "
              f"mean, {m['sync_probe_gap']:.2e} max")
        trained = ("--steps", "1", "--lr", "1e-3", "--warmup-steps", "0", *common)
        stapo.train(stapo.get_args(args_for(d, tmp_path / "compiled", "--compile-layers", "on", *trained)))
    finally:
        torch._dynamo.reset()
    stapo.train(stapo.get_args(args_for(d, tmp_path / "eager", *trained)))
    compiled, eager = metrics_of(tmp_path / "compiled"), metrics_of(tmp_path / "eager")
    assert all(x["eager_layer_calls"] == 0 for x in compiled + [m])
    for x in compiled + eager:  # the sync's probe gap is the trainer's against the engine's eager layers
        x.pop("eager_layer_calls", None), x.pop("sync_probe_gap"), x.pop("sync_probe_gap_mean")
    a, b = load_params(tmp_path / "compiled" / "model"), load_params(tmp_path / "eager" / "model")
    if dtype == "fp32":
        assert_same_params(a, b)
        assert_same_metrics(compiled, eager)
    else:
        assert compiled[0]["reward_mean"] == eager[0]["reward_mean"]  # the same samples in step 1
        assert compiled[0]["grad_norm"] == pytest.approx(eager[0]["grad_norm"], rel=0.05)
        assert_same_params(a, b, atol=1e-2)
