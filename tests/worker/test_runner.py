"""The flat batch (worker/input_batch.py) against a plain per-token oracle, over steps that reuse,
grow and reassign its cached block-table rows; and the `kernels` switch that runs the whole model
through the Triton kernels (the interpreter, on the CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.models import tiny_hf_model

from tinypaged import LLM, SamplingParams, envs
from tinypaged.kernels import norm
from tinypaged.scheduler import ScheduledSequence, Sequence
from tinypaged.worker.input_batch import HostBlockTables, build_step

BLOCK = 4

# Triton 3.6's interpreter turns loop bounds into ints through 1-element arrays (numpy < 2.4 warns)
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    tiny_hf_model("llama", num_hidden_layers=1).save_pretrained(path)
    return path


@pytest.fixture
def tables():
    return HostBlockTables(max_rows=4, max_blocks_per_seq=16)


def oracle(scheduled: list[ScheduledSequence]) -> dict[str, list]:
    """The flat batch one token at a time, straight from the definitions."""
    ids, positions, slots, logits_indices, row = [], [], [], [], 0
    for it in scheduled:
        for p in range(it.num_computed_tokens, it.num_computed_tokens + it.num_new_tokens):
            ids.append(it.seq.token_ids[p])
            positions.append(p)
            slots.append(it.seq.block_table[p // BLOCK] * BLOCK + p % BLOCK)
        row += it.num_new_tokens
        if it.sample:
            logits_indices.append(row - 1)
    return {"input_ids": ids, "positions": positions, "slot_mapping": slots,
            "logits_indices": logits_indices}


def check(tables: HostBlockTables, scheduled: list[ScheduledSequence]) -> None:
    step = build_step(scheduled, BLOCK, tables)
    for name, want in oracle(scheduled).items():
        assert getattr(step, name).tolist() == want, name
    width = step.block_tables.shape[1]
    for b, it in enumerate(scheduled):
        n = min(width, len(it.seq.block_table))
        assert step.block_tables[b, :n].tolist() == it.seq.block_table[:n], f"row {b}"
        assert not step.block_tables[b, n:].any(), f"row {b} past its table is not 0"
        assert step.seq_lens[b] == it.num_computed_tokens + it.num_new_tokens


def decode(seq: Sequence) -> ScheduledSequence:
    return ScheduledSequence(seq, 1, len(seq) - 1, sample=True)


def test_build_step_matches_the_oracle_as_rows_change_hands(tables):
    a = Sequence("a", list(range(10, 19)))  # 9 tokens: 3 blocks
    b = Sequence("b", list(range(30, 33)))
    a.block_table, b.block_table = [7, 3, 12], [5]
    # one-token prompt chunks: a step of one token per sequence that are not the last ones
    check(tables, [ScheduledSequence(a, 1, 0, sample=False), ScheduledSequence(b, 1, 0, False)])
    check(tables, [ScheduledSequence(a, 5, 1, sample=False), ScheduledSequence(b, 2, 1, True)])
    check(tables, [ScheduledSequence(a, 3, 6, sample=True), decode(b)])  # rows unchanged

    a.append_token(19)
    b.append_token(33)
    b.block_table.append(9)  # b's table grows while it keeps its row
    check(tables, [decode(a), decode(b)])

    # a is preempted and comes back in its row with as many blocks as before, but other ones
    a.num_preemptions += 1
    a.block_table = [40, 41, 42]
    b.append_token(34)
    check(tables, [ScheduledSequence(a, 10, 0, sample=True), decode(b)])

    # a short newcomer takes row 0 from a's longer table (its tail is cleared); a moves to row 1
    a.append_token(20)
    c = Sequence("c", [1, 2])
    c.block_table = [50]
    check(tables, [ScheduledSequence(c, 2, 0, sample=True), decode(a)])


def test_kernels_switch_runs_the_model_through_triton(llama_dir, monkeypatch):
    pytest.importorskip("triton")
    calls = []
    launcher = norm.rms_norm_triton
    monkeypatch.setattr(norm, "rms_norm_triton",
                        lambda *a, **k: calls.append(1) or launcher(*a, **k))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = [{"prompt_token_ids": [3, 1, 4, 1, 5]}, {"prompt_token_ids": list(range(20, 38))}]
    outs = {}
    for kernels in ("auto", "triton"):
        llm = LLM(str(llama_dir), block_size=16, num_kv_blocks=16, max_model_len=64,
                  skip_tokenizer_init=True, kernels=kernels)
        calls.clear()
        outs[kernels] = [o.outputs[0].token_ids
                         for o in llm.generate(prompts, params, use_tqdm=False)]
        assert bool(calls) == (kernels == "triton"), kernels
    assert outs["triton"] == outs["auto"]
    assert not norm.use_triton(torch.empty(0))  # the choice does not outlive the forward


@pytest.mark.filterwarnings("ignore:dtype=bfloat16 on the CPU is much slower")
def test_kernels_setting_from_the_environment_and_its_errors(llama_dir, monkeypatch):
    from tinypaged.config import EngineConfig

    monkeypatch.setenv("TINYPAGED_KERNELS", "torch")
    assert EngineConfig().kernels == "torch"
    assert EngineConfig(kernels="auto").kernels == "auto"
    with pytest.raises(ValueError, match="kernels must be auto, triton or torch; got 'cuda'$"):
        EngineConfig(kernels="cuda")
    monkeypatch.setenv("TINYPAGED_KERNELS", "fast")
    with pytest.raises(ValueError, match=r"got 'fast' \(from \$TINYPAGED_KERNELS\)"):
        EngineConfig()
    monkeypatch.delenv("TINYPAGED_KERNELS")
    pytest.importorskip("triton")
    with pytest.raises(ValueError, match="bfloat16 wrongly.*float32"):
        LLM(str(llama_dir), dtype="bfloat16", kernels="triton", num_kv_blocks=4,
            skip_tokenizer_init=True)


def test_the_torch_references_run_without_cuda_graphs():
    """The references sync with the host (a boolean-mask index in store_kv_ref), which a CUDA
    graph cannot capture: on a GPU, kernels='torch' runs eagerly (seen failing the capture on
    an H200 before)."""
    from tinypaged.config import EngineConfig
    from tinypaged.worker.model_runner import no_graphs_reason

    assert no_graphs_reason(EngineConfig()) is None
    assert no_graphs_reason(EngineConfig(kernels="triton")) is None
    assert no_graphs_reason(EngineConfig(enforce_eager=True)) == "enforce_eager"
    assert "torch references" in no_graphs_reason(EngineConfig(kernels="torch"))


def test_kernels_choice_is_scoped():
    from tinypaged.kernels._triton import HAS_TRITON, interpreting, kernel_choice, use_triton

    x = torch.empty(0)
    with kernel_choice("torch"):
        assert not use_triton(x)
        if HAS_TRITON:
            with kernel_choice("triton"):
                assert use_triton(x)
            assert not use_triton(x)
    assert use_triton(x) == (HAS_TRITON and interpreting())
    with pytest.raises(ValueError, match="got 'fast'"):
        kernel_choice("fast")


def test_block_rows_grow_for_a_batch_wider_than_max_num_seqs(tables):
    seqs = [Sequence(f"w{i}", [i + 1] * 3) for i in range(6)]  # 4 rows
    for i, s in enumerate(seqs):
        s.block_table = [i]
    check(tables, [ScheduledSequence(s, 3, 0, sample=True) for s in seqs])
    assert np.array_equal(build_step([decode(seqs[0])], BLOCK, tables).block_tables, [[0]])


def test_auto_verification_attention_follows_the_bucket():
    from tinypaged.worker.cuda_graphs import MULTI_QUERY_MAX_SEQS, verification_attention

    assert verification_attention("auto", 1) == "multi_query"
    assert verification_attention("auto", MULTI_QUERY_MAX_SEQS) == "multi_query"
    assert verification_attention("auto", MULTI_QUERY_MAX_SEQS + 1) == "varlen"
    assert verification_attention("decodes", 1) == "decodes"
    assert verification_attention(None, 1) is None  # a graph of one token a sequence


@pytest.mark.filterwarnings("ignore:divide by zero encountered in log2")  # empty splits
@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")  # the interpreter's
@pytest.mark.parametrize("mode", ["auto", "multi_query", "decodes", "varlen"])
def test_verification_graph_attends_as_the_eager_step(mode, monkeypatch):
    """A verification step (q = 3 tokens for each of 3 sequences) staged in a bucket of 4, as
    DecodeGraphs.run stages it: the metadata the graph's attention reads (TINYPAGED_SPEC_DECODE_
    ATTENTION: a uniform decode, one-token decodes, or the varlen batch), run through the Triton
    kernel it selects (interpreted), gives the eager step's attention on the real rows; the
    padding row reads block 0 only."""
    from types import SimpleNamespace

    from tinypaged.kernels import attention
    from tinypaged.kernels.attention import paged_attention_ref, paged_attention_triton
    from tinypaged.models.attention_metadata import AttentionMetadata
    from tinypaged.worker.cuda_graphs import DecodeGraphs, _Fields, verification_attention

    monkeypatch.setenv("TINYPAGED_SPEC_DECODE_ATTENTION", mode)
    q, bs, mb, batch = 3, 4, 6, 3
    seqs = [Sequence(f"v{i}", list(range(5 + 4 * i))) for i in range(batch)]
    for i, s in enumerate(seqs):
        s.block_table = list(range(1 + 6 * i, 1 + 6 * i + mb))
    # the last token and q - 1 drafts: k + 1 = q new tokens each
    items = [ScheduledSequence(s, q, len(s) - 1, True, [7] * (q - 1)) for s in seqs]
    step = build_step(items, BLOCK, HostBlockTables(8, mb), [True] * batch)
    host64, host32 = np.zeros(4 * bs * q, np.int64), np.zeros(bs * (1 + mb), np.int32)
    _Fields(host64, host32, bs, mb, q).fill(step, batch)
    dev = _Fields(torch.from_numpy(host64), torch.from_numpy(host32), bs, mb, q)
    graphs = SimpleNamespace(q=q, runner=SimpleNamespace(max_model_len=64),
                             query_start_loc=torch.arange(bs + 1, dtype=torch.int32) * q,
                             attention=envs.TINYPAGED_SPEC_DECODE_ATTENTION)  # __init__'s
    md = DecodeGraphs._metadata(graphs, dev, bs)
    mode = verification_attention(mode, bs)  # auto: multi_query for a bucket this small
    assert md.max_query_len == (1 if mode == "decodes" else q)
    assert md.uniform_decode == (mode == "multi_query")
    if mode != "varlen":  # the split-KV decode kernel, not the varlen one
        monkeypatch.setattr(attention, "varlen_attention_triton", None)
    g = torch.Generator().manual_seed(0)
    cache = [torch.randn(1 + 6 * batch, BLOCK, 2, 16, generator=g) for _ in range(2)]
    queries = torch.randn(bs * q, 4, 16, generator=g)
    graph_out = paged_attention_triton(
        queries, *cache, md.block_tables, md.seq_lens, md.query_start_loc, 0.3,
        max_query_len=md.max_query_len, max_seq_len=md.max_seq_len, num_splits=2,
        config={"block_n": 16, "block_m": 16}, uniform_decode=md.uniform_decode)
    eager = AttentionMetadata(*(torch.from_numpy(a) for a in (
        step.slot_mapping, step.query_start_loc, step.seq_lens, step.block_tables)),
        max_query_len=q, max_seq_len=step.max_seq_len)
    eager_out = paged_attention_ref(queries[: batch * q], *cache, eager.block_tables,
                                    eager.seq_lens, eager.query_start_loc, 0.3)
    torch.testing.assert_close(graph_out[: batch * q], eager_out, atol=1e-5, rtol=1e-5)


def test_graph_staging_layout_reads_back_on_the_device_side():
    """A decode step staged in a bucket's host layout (numpy over the pinned buffers) and copied
    flat, as DecodeGraphs.run does, reads back through the graph's views as the step's arrays,
    with padding rows that store nothing; a smaller bucket after a larger one leaves no stale
    entries."""
    from tinypaged.worker.cuda_graphs import _Fields

    mb, tables = 6, HostBlockTables(max_rows=8, max_blocks_per_seq=6)
    host64, host32 = np.zeros(4 * 8, np.int64), np.zeros(8 * (1 + mb), np.int32)
    seqs = [Sequence(f"g{i}", list(range(5 + 4 * i))) for i in range(5)]
    for i, s in enumerate(seqs):
        s.block_table = list(range(10 * i, 10 * i + 1 + len(s) // BLOCK))
    for batch, bs, ahead in ((5, 8, False), (3, 4, True)):
        # ahead: async scheduling, each token still on the device (row 2 - b of the last step)
        items = [ScheduledSequence(s, 1, len(s), True) if ahead else decode(s)
                 for s in seqs[:batch]]
        rows = {s.seq_id: 2 - b for b, s in enumerate(seqs[:batch])}
        step = build_step(items, BLOCK, tables, prev_sample_rows=rows if ahead else None)
        host = _Fields(host64, host32, bs, mb)
        host.fill(step, batch)
        dev = _Fields(torch.from_numpy(host64.copy()), torch.from_numpy(host32.copy()), bs, mb)
        assert dev.input_ids[:batch].tolist() == step.input_ids.tolist()
        assert dev.positions[:batch].tolist() == step.positions.tolist()
        assert dev.slot_mapping[:batch].tolist() == step.slot_mapping.tolist()
        assert dev.seq_lens[:batch].tolist() == step.seq_lens.tolist()
        want = [2 - b for b in range(batch)] if ahead else [-1] * batch
        assert dev.prev_sample_indices.tolist() == want + [-1] * (bs - batch)
        width = step.block_tables.shape[1]
        assert dev.block_tables[:batch, :width].tolist() == step.block_tables.tolist()
        assert not dev.block_tables[:batch, width:].any()
        assert (dev.slot_mapping[batch:] == -1).all() and (dev.seq_lens[batch:] == 1).all()
        assert not dev.block_tables[batch:].any() and not dev.input_ids[batch:].any()


def test_a_step_behind_a_verification_in_flight_moves_to_where_it_ended(tables):
    """build_step places the rows of a sequence behind a verification in flight as if every
    draft were accepted (its first row a placeholder); shift_to_verified then moves them on the
    device to what the oracle gives for the tokens that verification really emitted."""
    from tinypaged.kernels.spec_shift import shift_to_verified

    a = Sequence("a", list(range(10, 20)))  # 10 tokens; verified 3 drafts, 1 + 3 in flight
    b = Sequence("b", list(range(30, 36)))  # a plain decode beside it
    a.block_table, b.block_table = [7, 3, 12, 5], [9, 2]
    a.num_output_placeholders = 4
    drafts = [50, 51]
    behind = ScheduledSequence(a, 3, 13, sample=True, spec_token_ids=drafts)
    step = build_step([behind, decode(b)], BLOCK, tables, prev_sample_rows={a.seq_id: 1},
                      prev_assumed={a.seq_id: 4})
    assert step.verify_rows.tolist() == [1, -1] and step.verify_assumed.tolist() == [4, 0]
    assert step.input_ids.tolist()[:3] == [0, *drafts] and step.prev_sample_indices is None
    assert step.positions.tolist()[:3] == [13, 14, 15] and step.seq_lens.tolist() == [16, 6]
    # its verification accepted 1 of the 3 drafts and corrected the next: 2 tokens, not 4
    emitted = torch.tensor([[1, 2, 3, 4], [20, 77, -1, -1]])
    t = {name: torch.from_numpy(getattr(step, name).copy()) for name in
         ("input_ids", "positions", "slot_mapping", "seq_lens", "query_start_loc",
          "block_tables")}
    shift_to_verified(emitted, torch.from_numpy(step.verify_rows),
                      torch.from_numpy(step.verify_assumed), t["query_start_loc"],
                      t["block_tables"], BLOCK, t["input_ids"], t["positions"],
                      t["slot_mapping"], t["seq_lens"])
    a.token_ids += [20, 77, *drafts]  # the oracle reads the drafts from the tokens
    want = oracle([ScheduledSequence(a, 3, 11, sample=True), decode(b)])
    for name in ("input_ids", "positions", "slot_mapping"):
        assert t[name].tolist() == want[name], name
    assert t["seq_lens"].tolist() == [14, 6]


@pytest.mark.parametrize("triton", [False, True])
def test_a_graph_step_behind_a_verification_moves_in_the_static_inputs(triton):
    """As DecodeGraphs.run does it: a verification step (q = 3 rows a sequence) staged in a
    bucket's layout and copied flat, then moved in place through the bucket's device views,
    reads back as the same step moved eagerly; padding rows stay padding."""
    from tinypaged.kernels import spec_shift
    from tinypaged.worker.cuda_graphs import _Fields

    move = spec_shift.shift_to_verified_triton if triton else spec_shift.shift_to_verified_ref
    q, mb, bs = 3, 6, 4
    tables = HostBlockTables(max_rows=4, max_blocks_per_seq=mb)
    seqs = [Sequence(f"v{i}", list(range(9 + 3 * i))) for i in range(3)]
    items = []
    for i, s in enumerate(seqs):
        s.block_table = list(range(10 * i, 10 * i + mb))
        s.num_output_placeholders = 3  # 2 drafts in flight, assumed accepted, + its last token
        items.append(ScheduledSequence(s, q, len(s) + 2, True, spec_token_ids=[60 + i, 70 + i]))
    step = build_step(items, BLOCK, tables, prev_sample_rows={s.seq_id: 2 - i for i, s in
                                                               enumerate(seqs)},
                      prev_assumed={s.seq_id: 3 for s in seqs})
    emitted = torch.tensor([[5, 6, 7], [8, -1, -1], [9, 10, -1]])  # rows of seqs 2, 1, 0
    rows, assumed = torch.from_numpy(step.verify_rows), torch.from_numpy(step.verify_assumed)
    eager = {n: torch.from_numpy(getattr(step, n).copy()) for n in
             ("input_ids", "positions", "slot_mapping", "seq_lens")}
    move(emitted, rows, assumed, torch.from_numpy(step.query_start_loc),
         torch.from_numpy(step.block_tables), BLOCK, eager["input_ids"], eager["positions"],
         eager["slot_mapping"], eager["seq_lens"])
    host64, host32 = np.zeros(4 * bs * q, np.int64), np.zeros(bs * (1 + mb), np.int32)
    _Fields(host64, host32, bs, mb, q).fill(step, len(seqs))
    dev = _Fields(torch.from_numpy(host64.copy()), torch.from_numpy(host32.copy()), bs, mb, q)
    qsl = torch.arange(len(seqs) + 1, dtype=torch.int32) * q
    move(emitted, rows, assumed, qsl, dev.block_tables, BLOCK, dev.input_ids, dev.positions,
         dev.slot_mapping, dev.seq_lens)
    t = len(seqs) * q
    for name in ("input_ids", "positions", "slot_mapping"):
        assert getattr(dev, name)[:t].tolist() == eager[name].tolist(), name
    assert dev.seq_lens[: len(seqs)].tolist() == eager["seq_lens"].tolist()
    assert eager["input_ids"][::q].tolist() == [10, 8, 7]  # each one's last emitted token
    assert (dev.slot_mapping[t:] == -1).all() and (dev.seq_lens[len(seqs):] == q).all()
