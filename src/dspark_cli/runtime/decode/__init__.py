"""decode/: speculative decoding of one prompt (the loop); measuring many prompts is measure/.

- speculative.py  `speculative_generate`: prefill, then rounds of draft -> score -> accept -> commit -> advance;
                  `autoregressive_generate`, the plain baseline
- markov.py       the sequential Markov stage: one walk, a bias function per strategy
- sampling.py     processed logits, lossless acceptance (greedy and rejection sampling)
- timing.py       `SectionTimer`: ms per named step of a round
- chat.py         prompt -> token ids, chat templates rendered with bounded cost
The public way in is `dspark_cli.runtime.pair.Pair`.
"""
