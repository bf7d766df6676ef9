"""Token-level constraints for a plan: the processors the decode loop applies before sampling.

Today: the thinking budget. Grammar masks (tool_choice required / named, response formats) are
added here as processors too, so the engine sees only "edit these logits".
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from turbospark.backend import LogitsProcessor
from turbospark.reasoning import ThinkingBudget

if TYPE_CHECKING:
    from turbospark.plan import Plan


def processors_for_plan(plan: Plan) -> list[LogitsProcessor]:
    out: list[LogitsProcessor] = []
    tokenizer = plan.backend.tokenizer
    open_id, close_id = tokenizer.token_to_id("<think>"), tokenizer.token_to_id("</think>")
    if plan.thinking_budget is not None and open_id is not None and close_id is not None:
        out.append(ThinkingBudget(plan.thinking_budget, open_id, close_id, plan.start_in_reasoning))
    return out
