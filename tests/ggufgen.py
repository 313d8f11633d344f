"""A tiny random-weight llama GGUF for tests that run a real engine (llama-server) on CPU.

`make_tiny_gguf(path)` writes a model of a few hundred KB: the llama architecture, 2 layers,
64 wide, 4 attention heads over 2 KV heads, a 128-wide feed-forward block, a 512-token context,
a SentencePiece ("llama") vocabulary with byte fallback and ChatML special tokens, and a ChatML
chat template. It loads in milliseconds; its text is gibberish, but the protocol, token counts,
slots and streaming of the engine serving it are real.

Needs the `gguf` and `numpy` packages (the `dev` extra).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["CHATML_TEMPLATE", "TINY", "make_tiny_gguf"]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

#: The shape of the model, for tests that want to check what the engine reports.
TINY = {
    "block_count": 2,
    "embedding_length": 64,
    "head_count": 4,
    "head_count_kv": 2,
    "feed_forward_length": 128,
    "context_length": 512,
}

# A few whole pieces so that decoded text is not only raw bytes ("▁" marks a leading space).
_PIECES = ["▁", *"abcdefghijklmnopqrstuvwxyz", "▁the", "▁a", "▁of", "▁and", "▁to", "▁is", "▁llm", "▁gw", ".", ","]


def _vocabulary() -> tuple[list[str], list[float], list[int], dict[str, int]]:
    from gguf import TokenType

    tokens: list[str] = []
    scores: list[float] = []
    types: list[int] = []

    def add(text: str, kind: TokenType, score: float = 0.0) -> int:
        tokens.append(text)
        scores.append(score)
        types.append(int(kind))
        return len(tokens) - 1

    ids = {
        "unk": add("<unk>", TokenType.UNKNOWN),
        "bos": add("<s>", TokenType.CONTROL),
        "eos": add("</s>", TokenType.CONTROL),
    }
    for byte in range(256):
        add(f"<0x{byte:02X}>", TokenType.BYTE)
    for piece in _PIECES:
        add(piece, TokenType.NORMAL, -float(len(piece)))
    ids["im_start"] = add("<|im_start|>", TokenType.CONTROL)
    ids["im_end"] = add("<|im_end|>", TokenType.CONTROL)
    return tokens, scores, types, ids


def output_weights(rng: object, types: list[int], n_embd: int) -> object:
    """The output layer: strong random rows for the whole pieces, zero rows for everything else.

    With small random rows every token is about as likely, so half of what the model says would
    be raw bytes (often not valid UTF-8, which the engine holds back) and an answer of several
    tokens could show no text at all. Zero rows give bytes, control tokens and the end-of-text
    tokens a logit of 0 while the best pieces score far above it: answers are readable text of
    the length asked for, and the same prompt gets much the same answer.
    """
    import numpy as np
    from gguf import TokenType

    generator: np.random.Generator = rng  # type: ignore[assignment]
    rows = np.zeros((len(types), n_embd), dtype=np.float32)
    for index, kind in enumerate(types):
        if kind == int(TokenType.NORMAL):
            rows[index] = generator.standard_normal(n_embd).astype(np.float32)
    return rows


def make_tiny_gguf(path: Path, *, seed: int = 0) -> Path:
    """Write the tiny model to `path` (parents created) and return `path`."""
    import gguf
    import numpy as np

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    n_embd = TINY["embedding_length"]
    n_head = TINY["head_count"]
    n_head_kv = TINY["head_count_kv"]
    n_ff = TINY["feed_forward_length"]
    head_dim = n_embd // n_head
    n_embd_kv = head_dim * n_head_kv
    tokens, scores, types, ids = _vocabulary()
    n_vocab = len(tokens)

    def weights(*shape: int) -> np.ndarray:
        # numpy shapes are (rows, columns); GGUF stores them reversed, as ggml's (ne0, ne1).
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("llmgw tiny test model")
    writer.add_context_length(TINY["context_length"])
    writer.add_embedding_length(n_embd)
    writer.add_block_count(TINY["block_count"])
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(ids["bos"])
    writer.add_eos_token_id(ids["eos"])
    writer.add_unk_token_id(ids["unk"])
    writer.add_eot_token_id(ids["im_end"])
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_chat_template(CHATML_TEMPLATE)

    writer.add_tensor("token_embd.weight", weights(n_vocab, n_embd))
    for layer in range(TINY["block_count"]):
        prefix = f"blk.{layer}"
        writer.add_tensor(f"{prefix}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        writer.add_tensor(f"{prefix}.attn_q.weight", weights(n_embd, n_embd))
        writer.add_tensor(f"{prefix}.attn_k.weight", weights(n_embd_kv, n_embd))
        writer.add_tensor(f"{prefix}.attn_v.weight", weights(n_embd_kv, n_embd))
        writer.add_tensor(f"{prefix}.attn_output.weight", weights(n_embd, n_embd))
        writer.add_tensor(f"{prefix}.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        writer.add_tensor(f"{prefix}.ffn_gate.weight", weights(n_ff, n_embd))
        writer.add_tensor(f"{prefix}.ffn_up.weight", weights(n_ff, n_embd))
        writer.add_tensor(f"{prefix}.ffn_down.weight", weights(n_embd, n_ff))
    writer.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    writer.add_tensor("output.weight", output_weights(rng, types, n_embd))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


if __name__ == "__main__":
    import sys

    target = make_tiny_gguf(Path(sys.argv[1] if len(sys.argv) > 1 else "tiny.gguf"))
    print(f"{target} ({target.stat().st_size} bytes)")
