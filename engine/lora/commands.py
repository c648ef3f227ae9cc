"""An engine worker's answer to POST /v1/load_lora_adapter or /unload (a LoRACommand the
orchestrator fanned out): done here, or why not."""

from __future__ import annotations

import logging

from common.protocol import LoRACommand, LoRADone
from engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)


def apply_lora_command(engine: LLMEngine, worker_id: str, command: LoRACommand) -> LoRADone:
    done = LoRADone(action=command.action, lora_name=command.lora_name)
    try:
        if command.action == "load":
            engine.load_lora_adapter(command.lora_name, command.lora_path)
        else:
            engine.unload_lora_adapter(command.lora_name)
    except (ValueError, OSError) as e:
        done.errors.append(f"{worker_id}: {e}")
        logger.warning("LoRA %s of %s refused: %s", command.action, command.lora_name, e)
        return done
    logger.info("LoRA adapter %s %sed", command.lora_name, command.action)
    done.workers.append(worker_id)
    return done
