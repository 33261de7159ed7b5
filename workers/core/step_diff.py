"""The step's diff for the workers (`workers.messages.step.StepInput`), built from the
scheduler's sequences: what the workers do not hold yet goes whole, the rest as changes."""

from __future__ import annotations

from workers.core.scheduler import SchedulerOutput
from workers.lora.request import LoRARequest
from workers.messages.step import CachedSeq, GrammarBitmask, NewSeq, StepInput


def build_step_input(
    sched: SchedulerOutput,
    removed: list[str],
    grammar: GrammarBitmask | None,
    lora_loads: list[tuple[int, LoRARequest]],
) -> StepInput:
    """The step's diff for the workers: a sequence they do not hold yet goes whole, the others
    as what changed since the last step that sent them (module doc)."""
    step = StepInput(
        removed=removed, grammar=grammar, lora_loads=lora_loads, kv_transfers=sched.kv_transfers
    )
    for seq, n in sched.scheduled:
        if not seq.on_workers:
            step.new.append(
                NewSeq(
                    seq.seq_id,
                    seq.prompt_token_ids,
                    list(seq.token_ids),
                    seq.params,
                    list(seq.block_ids),
                    seq.num_computed_tokens,
                    n,
                    seq.lora_slot,
                )
            )
            seq.on_workers = True
        else:
            step.cached.append(
                CachedSeq(
                    seq.seq_id,
                    seq.token_ids[seq.sent_tokens :],
                    seq.block_ids[seq.sent_blocks :],
                    seq.num_computed_tokens,
                    n,
                    list(seq.draft),
                )
            )
        seq.sent_tokens = len(seq.token_ids)
        seq.sent_blocks = len(seq.block_ids)
    return step
