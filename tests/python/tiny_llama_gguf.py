"""Writes tiny-llama: a llama-architecture GGUF with random weights, for weir's llama.cpp tests.

Small enough that llama-server loads it at once and decodes a token in about a millisecond on a
CPU, real enough that everything around the weights is the real engine's: its tokenizer (a
byte-level BPE with merges learnt below from a short English text, 4 special tokens), the
ChatML template, slots, prompt cache, usage counts and metrics. What it writes is nonsense.

usage: python tiny_llama_gguf.py GGUF_PY_DIR OUT_FILE
  GGUF_PY_DIR  the gguf-py package vendored in the llama.cpp sources (its own pinned writer)
"""

import re
import sys
from collections import Counter

sys.path.insert(0, sys.argv[1])
import gguf  # noqa: E402
import numpy as np  # noqa: E402

EMBD, LAYERS, HEADS, KV_HEADS, FFN, CONTEXT = 256, 2, 4, 2, 512, 2048
VOCAB = 2048
SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n'"
    " + message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# What the merges are learnt from: the words weir's prompts are made of, so a prompt's token
# count on the engine is of the order of the gateway's estimate.
CORPUS = """
weir protects a shared pool of language model engines from its tenants and its tenants from
each other. It budgets and schedules in tokens, memory and time, never in requests. The front
door authenticates, estimates, reserves or rejects; the scheduler decides who goes next, where
it runs and whether it fits in the cache, while work runs. Billing is exact and comes from the
usage the engine reports. Small tenants ask short questions and get quick answers; a noisy
neighbour sends a flood of bulk summaries with long prompts and long answers. Pack the cache,
hello, please answer briefly, tell me a story about a river, a mill and the water that runs
over the weir, summarise this document, translate the following text, what is the capital of
France, write a poem about the sea, explain how the fair scheduler shares the pool between the
tenants by weight, the quick brown fox jumps over the lazy dog, one two three four five six
seven eight nine ten, the system prompt of a shared assistant, you are a helpful assistant.
"""


def bytes_to_unicode():
    """GPT-2's reversible map from bytes to printable characters (llama.cpp's BPE expects it)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def learn_merges(text, budget):
    """Byte-pair merges, most frequent pair first, over the GPT-2 pre-tokenisation of `text`."""
    to_char = bytes_to_unicode()
    words = Counter(
        tuple(to_char[b] for b in piece.encode())
        for piece in re.findall(r" ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+", text)
    )
    merges = []
    while len(merges) < budget:
        pairs = Counter()
        for word, n in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += n
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        joined = best[0] + best[1]
        merged = Counter()
        for word, n in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(joined)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += n
        words = merged
    return merges


def main():
    out = sys.argv[2]
    base = [bytes_to_unicode()[b] for b in range(256)]
    merges = learn_merges(CORPUS, VOCAB - len(base) - len(SPECIAL))
    tokens = base + [a + b for a, b in merges] + SPECIAL
    types = [gguf.TokenType.NORMAL] * (len(tokens) - len(SPECIAL)) + [gguf.TokenType.CONTROL] * len(SPECIAL)
    vocab = len(tokens)

    w = gguf.GGUFWriter(out, "llama")
    w.add_name("tiny-llama")
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_vocab_size(vocab)
    w.add_context_length(CONTEXT)
    w.add_embedding_length(EMBD)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(EMBD // HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([f"{a} {b}" for a, b in merges])
    w.add_bos_token_id(tokens.index("<|begin_of_text|>"))
    w.add_eos_token_id(tokens.index("<|end_of_text|>"))
    w.add_eot_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(False)  # the template writes it
    w.add_chat_template(CHAT_TEMPLATE)

    rng = np.random.default_rng(0)
    head = EMBD // HEADS

    def weight(*shape):
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    ones = np.ones(EMBD, dtype=np.float32)
    w.add_tensor("token_embd.weight", weight(vocab, EMBD))
    for i in range(LAYERS):
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.attn_q.weight", weight(HEADS * head, EMBD))
        w.add_tensor(f"blk.{i}.attn_k.weight", weight(KV_HEADS * head, EMBD))
        w.add_tensor(f"blk.{i}.attn_v.weight", weight(KV_HEADS * head, EMBD))
        w.add_tensor(f"blk.{i}.attn_output.weight", weight(EMBD, HEADS * head))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.ffn_gate.weight", weight(FFN, EMBD))
        w.add_tensor(f"blk.{i}.ffn_up.weight", weight(FFN, EMBD))
        w.add_tensor(f"blk.{i}.ffn_down.weight", weight(EMBD, FFN))
    w.add_tensor("output_norm.weight", ones)
    w.add_tensor("output.weight", weight(vocab, EMBD))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
