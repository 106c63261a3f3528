#!/usr/bin/env python3
"""Creates the demo's tiny Qwen2-architecture model with random weights (initialised as transformers
initialises a new model: normal(0, 0.02), norms 1, biases 0) next to the shipped tokenizer, so the
demo fine-tunes from scratch without downloading anything."""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "support"))
from tiny_model import config, parameter_count, write_model  # noqa: E402  (the tiny models the tests use too)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("output", help="model folder to create")
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--intermediate-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    c = config(model_type="qwen2", hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
               num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
               rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=512, attention_dropout=0.0,
               use_sliding_window=False)
    c = write_model(args.output, c, seed=args.seed, weight_std=0.02, norm_std=0.0,
                    tokenizer_dir=os.path.join(HERE, "tokenizer"))
    print(f"created {args.output}: Qwen2 architecture, {args.layers} layers, hidden {args.hidden_size}, "
          f"vocab {c['vocab_size']}, {parameter_count(c) / 1e6:.2f}M parameters, random weights (seed {args.seed})")


if __name__ == "__main__":
    main()
