"""How the scheduler takes a sequence's draft (workers/core/scheduler.py): its last token and as
much of the draft as the token budget allows; no draft rather than a preemption for it."""

from __future__ import annotations

from workers.config import SchedulerConfig
from workers.core.block_manager import BlockManager
from workers.core.request import Seq, SeqStatus
from workers.core.scheduler import Scheduler
from workers.sampling_params import SamplingParams


def _decoding(sched: Scheduler, prompt_len: int, sid: str) -> Seq:
    """A sequence whose prompt ran and whose first token is known: a decode."""
    seq = Seq(sid, sid, 0, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=100))
    sched.add(seq)
    out = sched.schedule()
    assert (seq, prompt_len) in out.scheduled
    seq.num_computed_tokens = prompt_len
    seq.token_ids.append(7)
    return seq


def test_the_draft_is_scheduled_with_the_last_token_and_cut_to_the_budget() -> None:
    bm = BlockManager(num_blocks=64, block_size=4)
    sched = Scheduler(SchedulerConfig(max_model_len=256, max_num_batched_tokens=4), bm)
    seq = _decoding(sched, 4, "a")
    seq.draft = [8, 9, 10, 11, 12]
    out = sched.schedule()
    assert out.scheduled == [(seq, 4)] and seq.draft == [8, 9, 10]  # 1 + 3 = the budget
    assert len(seq.block_ids) == 2  # positions 4..7: a second block


def test_without_blocks_for_the_draft_the_sequence_decodes_one_token() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    sched = Scheduler(SchedulerConfig(max_model_len=64, max_num_batched_tokens=64), bm)
    a = _decoding(sched, 4, "a")  # 1 block; its next token needs a second
    b = _decoding(sched, 4, "b")  # 1 block; likewise: two free blocks are just enough
    a.draft = [1, 2, 3, 4, 5, 6, 7, 8]  # positions 4..12: three more blocks
    out = sched.schedule()
    assert (a, 1) in out.scheduled and (b, 1) in out.scheduled and a.draft == []
    assert not out.preempted and b.status is SeqStatus.RUNNING
