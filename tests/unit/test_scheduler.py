"""The scheduler alone, with exact ids: priority order of admission, budget and preemption."""

from __future__ import annotations

from common.sampling_params import SamplingParams
from engine.kv_cache_manager import KVCacheManager
from engine.sampler import SampleResult, SamplingState
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Sequence, SequenceStatus

BLOCK = 4


def scheduler(num_blocks: int = 64, max_num_seqs: int = 8, budget: int = 64) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, BLOCK), max_num_seqs, budget, max_model_len=256)


def seq(seq_id: str, priority: int = 0, prompt_len: int = 8) -> Sequence:
    prompt = [hash(seq_id) % 1000 + i for i in range(prompt_len)]  # no prefix shared by chance
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    state = SamplingState(params=params, prompt_token_ids=prompt)
    s = Sequence(seq_id, seq_id, 0, list(prompt), prompt_len, state)
    s.priority = priority
    return s


def scheduled(out: SchedulerOutput) -> list[str]:
    return [chunk.seq.seq_id for chunk in out.chunks]


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
