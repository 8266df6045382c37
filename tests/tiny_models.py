"""Tiny random Hugging Face models and a real byte-level BPE tokenizer, saved to disk.

They load through the same `from_pretrained` code a user's Llama or Qwen takes. The draft is
the target with noise added to its weights, so it agrees often but not always — both the
accept and the reject paths get exercised.
"""

from __future__ import annotations

import os

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    print(i * i)\n",
    "import os\nimport sys\n\nprint(os.getcwd(), sys.argv)\n",
    '"""Docstring with unicode: héllo wörld 日本語 🙂."""\n',
    "if x is None:\n    raise ValueError('x must not be None')\n",
] * 20


def build_tokenizer(directory: str, vocab_size: int = 320) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.save_pretrained(directory)
    return fast


def _save(model, tokenizer, directory: str) -> str:
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


# the shape of the tiny models of other architectures (tests of attention and forward paths)
ARCHITECTURE_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
)


def save_architecture(config_class: str, extra: dict, tokenizer, directory: str) -> str:
    """A tiny random model of `transformers.<config_class>` (ARCHITECTURE_SHAPE + `extra`,
    seed 0) saved with `tokenizer` to `directory`."""
    import transformers

    config = getattr(transformers, config_class)(
        vocab_size=len(tokenizer), **ARCHITECTURE_SHAPE, **extra
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    return _save(model, tokenizer, directory)


def llama(vocab: int, layers: int, hidden: int, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,  # spread-out logits: few near-ties in greedy tests
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    return LlamaForCausalLM(config).eval()


def build_model_dirs(root: str) -> dict[str, str]:
    """target (Llama), draft (noisy copy of target), gpt2 (other architecture), other_vocab."""
    tokenizer = build_tokenizer(os.path.join(root, "tokenizer"))
    vocab = len(tokenizer)
    target = llama(vocab, layers=2, hidden=64, seed=0)
    draft = llama(vocab, layers=2, hidden=64, seed=0)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(1)
        for param in draft.parameters():
            param.add_(0.01 * torch.randn(param.shape, generator=generator))
    torch.manual_seed(2)
    gpt2 = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=vocab, n_embd=64, n_layer=2, n_head=4, n_positions=512, initializer_range=0.2
        )
    ).eval()
    other_tokenizer = build_tokenizer(os.path.join(root, "other_tokenizer"), vocab_size=300)
    other = llama(len(other_tokenizer), layers=1, hidden=32, seed=3)
    return {
        "target": _save(target, tokenizer, os.path.join(root, "target")),
        "draft": _save(draft, tokenizer, os.path.join(root, "draft")),
        "gpt2": _save(gpt2, tokenizer, os.path.join(root, "gpt2")),
        "other_vocab": _save(other, other_tokenizer, os.path.join(root, "other_vocab")),
    }


def fresh_logits(runtime, history: list[int]) -> torch.Tensor:
    """The logits of `history` in one fresh forward of the runtime's model (no cache): what
    every batched or cached forward of the same tokens must equal."""
    with torch.inference_mode():
        return runtime.model(input_ids=torch.tensor([history])).logits[0].float()
