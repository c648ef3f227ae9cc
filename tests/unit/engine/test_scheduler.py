"""The scheduler alone, with exact ids: admission (priority, FIFO, max_num_seqs, a prefix hit),
the token budget and chunked prefill, preemption order."""

from __future__ import annotations

from common.sampling_params import SamplingParams
from engine.kv_cache_manager import KVCacheManager
from engine.sampler import SampleResult, SamplingState
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Sequence, SequenceStatus

BLOCK = 4


def scheduler(
    num_blocks: int = 64, max_num_seqs: int = 8, budget: int = 64, fill: int | None = None
) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, BLOCK), max_num_seqs, budget, max_model_len=256,
                     step_fill_tokens=fill)  # fmt: skip


def seq(seq_id: str, priority: int = 0, prompt_len: int = 8) -> Sequence:
    prompt = [hash(seq_id) % 1000 + i for i in range(prompt_len)]  # no prefix shared by chance
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    state = SamplingState(params=params, prompt_token_ids=prompt)
    s = Sequence(seq_id, seq_id, 0, list(prompt), prompt_len, state)
    s.priority = priority
    return s


def scheduled(out: SchedulerOutput) -> list[str]:
    return [chunk.seq.seq_id for chunk in out.chunks]


def chunks(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(chunk.seq.seq_id, chunk.num_new_tokens) for chunk in out.chunks]


def run(sched: Scheduler, out: SchedulerOutput) -> None:
    """Finish the step as the engine would: every chunk that reaches its end samples token 7."""
    sampled = [chunk.seq for chunk in out.chunks if chunk.samples]
    sched.postprocess(out, sampled, SampleResult([7] * len(sampled), None, None))


def test_higher_priority_is_admitted_first_and_fifo_within_a_level() -> None:
    sched = scheduler(max_num_seqs=1)
    for s in (seq("low-a", 0), seq("low-b", 0), seq("high-a", 5), seq("high-b", 5), seq("mid", 2)):
        sched.add(s)
    assert [s.seq_id for s in sched.waiting] == ["high-a", "high-b", "mid", "low-a", "low-b"]
    order = []
    while sched.waiting or sched.running:
        out = sched.schedule()
        order += [i for i in scheduled(out) if i not in order]
        run(sched, out)
        for s in list(sched.running):
            sched._finish(s, "stop")  # one step each: make room for the next
    assert order == ["high-a", "high-b", "mid", "low-a", "low-b"]


def test_the_budget_goes_to_the_higher_priority_prefill_first() -> None:
    sched = scheduler(budget=12)
    sched.add(seq("low", 0, prompt_len=8))
    sched.add(seq("high", 1, prompt_len=8))
    out = sched.schedule()
    assert [(c.seq.seq_id, c.num_new_tokens) for c in out.chunks] == [("high", 8), ("low", 4)]
    run(sched, out)
    sched.add(seq("top", 9, prompt_len=8))  # arrives while both run
    out = sched.schedule()  # running first, in priority order, then the newcomer
    assert [(c.seq.seq_id, c.num_new_tokens) for c in out.chunks] == [
        ("high", 1),
        ("low", 4),
        ("top", 7),
    ]
    assert [s.seq_id for s in sched.running] == ["top", "high", "low"]


def test_preemption_takes_the_lowest_priority_and_it_keeps_its_place() -> None:
    # 6 blocks of 4 tokens: three 8-token prompts take 2 blocks each, so the next token of any
    # of them needs a block that only a preemption frees
    sched = scheduler(num_blocks=6)
    for s in (seq("low", 0), seq("high", 3), seq("mid", 1)):
        sched.add(s)
    run(sched, sched.schedule())
    assert [s.seq_id for s in sched.running] == ["high", "mid", "low"]
    sched.add(seq("low-later", 0))
    out = sched.schedule()
    assert [s.seq_id for s in out.preempted] == ["low"]  # not the most recent admission
    assert scheduled(out) == ["high", "mid"]
    victim = out.preempted[0]
    assert victim.status is SequenceStatus.WAITING and victim.priority == 0
    # back in the queue ahead of a same-priority request that arrived after it
    assert [s.seq_id for s in sched.waiting] == ["low", "low-later"]


def test_equal_priorities_preempt_the_latest_admission_first() -> None:
    # 7 blocks of 4: three 8-token prompts fill 6; the first decode of "a" takes the 7th, the
    # next token of "b" needs one more, which only a preemption of the tail frees: "c", then
    # (its blocks not enough for "c" itself) nothing more
    sched = scheduler(num_blocks=7)
    for s in (seq("a"), seq("b"), seq("c")):
        sched.add(s)
    run(sched, sched.schedule())
    assert [s.seq_id for s in sched.running] == ["a", "b", "c"]
    out = sched.schedule()
    assert [s.seq_id for s in out.preempted] == ["c"]
    assert [(c.seq.seq_id, c.num_new_tokens) for c in out.chunks] == [("a", 1), ("b", 1)]
    assert [s.seq_id for s in sched.waiting] == ["c"] and sched.waiting[0].num_computed_tokens == 0
    assert sched.kv.num_free_blocks == 1  # c's two blocks back, a and b took one each


def test_a_long_prompt_is_chunked_by_the_budget_and_decodes_go_first() -> None:
    sched = scheduler(budget=10)
    sched.add(seq("short", prompt_len=4))
    sched.add(seq("long", prompt_len=23))
    out = sched.schedule()
    assert [(c.seq.seq_id, c.num_new_tokens) for c in out.chunks] == [("short", 4), ("long", 6)]
    assert [c.samples for c in out.chunks] == [True, False]  # a partial chunk samples nothing
    run(sched, out)
    for expected_long, long_samples in ((9, False), (8, True)):  # 6 + 9 + 8 = 23
        out = sched.schedule()  # short's decode first, the rest of the budget to the chunk
        assert [(c.seq.seq_id, c.num_new_tokens) for c in out.chunks] == [
            ("short", 1),
            ("long", expected_long),
        ]
        assert [c.samples for c in out.chunks] == [True, long_samples]
        run(sched, out)
    assert sched.running[1].num_computed_tokens == 23 and sched.running[1].output_token_ids == [7]


def test_prompt_chunks_start_only_below_the_fill_and_the_one_crossing_it_runs_whole() -> None:
    """Budget 64, fill 10: short prompts share a step until it holds 10 prompt tokens (first
    tokens one step after another); the prompt that crosses 10 is not cut there but runs on
    within the budget; a prompt longer than the budget is chunked by the budget."""
    sched = scheduler(num_blocks=64, budget=64, fill=10)
    for name, length in (("a", 4), ("b", 4), ("long", 30), ("c", 4)):
        sched.add(seq(name, prompt_len=length))
    out = sched.schedule()  # a, b (8 tokens), then long crosses 10 and runs whole: c waits
    assert chunks(out) == [("a", 4), ("b", 4), ("long", 30)]
    run(sched, out)
    out = sched.schedule()  # three decodes, then c's prompt
    assert chunks(out) == [("a", 1), ("b", 1), ("long", 1), ("c", 4)]
    run(sched, out)
    sched.add(seq("late", prompt_len=80))
    out = sched.schedule()  # four decodes, then late's first chunk: the budget's 60 tokens left
    assert chunks(out)[-1] == ("late", 60)
    run(sched, out)
    sched.add(seq("later", prompt_len=4))
    out = sched.schedule()  # late's rest (20) crosses the fill: later waits for the next step
    assert chunks(out)[-1] == ("late", 20) and "later" not in scheduled(out)
    run(sched, out)
    assert chunks(sched.schedule())[-1] == ("later", 4)


def test_decodes_never_keep_a_prompt_from_starting_and_run_behind_one_that_waits() -> None:
    """Fill 3 with more decodes than that: prompts still start (only prompt tokens count);
    a prompt part way waits once the step holds 3 prompt tokens, and the decode queued behind
    it runs all the same."""
    sched = scheduler(num_blocks=64, budget=64, fill=3)
    for name, priority in (("d1", 9), ("d2", 9), ("d3", 9), ("d4", -1)):
        sched.add(seq(name, priority, prompt_len=2))
    run(sched, sched.schedule())  # d1, d2 (4 prompt tokens): the rest wait
    run(sched, sched.schedule())  # d1, d2 decode; d3 starts (2 < 3), d4 too (crossing)
    assert [s.seq_id for s in sched.running] == ["d1", "d2", "d3", "d4"]
    sched.add(seq("p", 0, prompt_len=100))  # between the decodes in the queue; past the budget
    out = sched.schedule()
    assert chunks(out) == [("d1", 1), ("d2", 1), ("d3", 1), ("d4", 1), ("p", 60)]
    run(sched, out)
    sched.add(seq("q", 0, prompt_len=4))
    out = sched.schedule()  # p's rest (40) crosses the fill: q waits
    assert chunks(out) == [("d1", 1), ("d2", 1), ("d3", 1), ("p", 40), ("d4", 1)]
    run(sched, out)


def test_a_prompt_with_a_cached_prefix_is_admitted_past_its_cached_blocks() -> None:
    sched = scheduler()
    first = seq("first", prompt_len=10)
    sched.add(first)
    run(sched, sched.schedule())
    sched._finish(first, "stop")  # its two full blocks stay in the prefix cache
    second = seq("second", prompt_len=12)
    second.token_ids[:10] = first.token_ids[:10]
    sched.add(second)
    out = sched.schedule()
    # 8 tokens (two full blocks of 4) are cached; the 2 of the partial block and 2 more run
    assert [(c.seq.seq_id, c.num_new_tokens) for c in out.chunks] == [("second", 4)]
    assert second.num_computed_tokens == 8 and second.num_cached_prompt_tokens == 8
    assert (sched.prefix_queried_tokens, sched.prefix_hit_tokens) == (10 + 12, 8)


def test_admission_stops_at_max_num_seqs_and_resumes_when_one_finishes() -> None:
    sched = scheduler(max_num_seqs=2)
    for name in ("a", "b", "c"):
        sched.add(seq(name))
    out = sched.schedule()
    assert scheduled(out) == ["a", "b"] and [s.seq_id for s in sched.waiting] == ["c"]
    run(sched, out)
    sched._finish(sched.running[0], "stop")
    out = sched.schedule()
    assert [(c.seq.seq_id, c.num_new_tokens) for c in out.chunks] == [("b", 1), ("c", 8)]
