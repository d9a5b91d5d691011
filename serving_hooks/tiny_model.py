"""`adapt tiny-model DIR`: a tiny random Llama and a small trained tokenizer, made locally.

Nothing may be fetched from a model hub, yet the vLLM integration needs a real model directory.
This writes one from scratch: a 2-layer Llama (hidden 128, 2 heads of 64 -- the CPU attention
backend rejects a head size of 16 -- vocabulary 512) with random weights in safetensors, and a
byte-level BPE tokenizer trained on generated text. It generates gibberish, quickly: enough to
exercise scheduling end to end on a CPU.
"""

from __future__ import annotations

import random
from pathlib import Path

VOCAB_SIZE = 512
WORDS = [
    "the",
    "request",
    "token",
    "queue",
    "batch",
    "prefill",
    "decode",
    "cache",
    "model",
    "server",
    "latency",
    "deadline",
    "schedule",
    "policy",
    "short",
    "long",
    "prompt",
    "output",
    "tier",
    "paying",
    "free",
    "replay",
    "engine",
    "block",
    "memory",
    "swap",
    "alias",
]


def _corpus(lines: int = 2000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 24))) for _ in range(lines)]


# vLLM arguments that fit the tiny model on a CPU: short context, fp32, no graph capture, and a
# small share of RAM for the KV cache (`--gpu-memory-utilization` is RAM on the CPU backend).
VLLM_CPU_ARGS: tuple[str, ...] = (
    "--max-model-len",
    "1024",
    "--dtype",
    "float32",
    "--enforce-eager",
    "--max-num-seqs",
    "4",
    "--gpu-memory-utilization",
    "0.2",
)


def make_tiny_model(directory: str | Path, seed: int = 0) -> Path:
    """Write config, safetensors weights and tokenizer files to `directory`; returns it."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(directory)

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
    )
    LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    return directory
