"""The example's data: what the batches are made of, and how.

  corpus.py          the sources: the user's files, held-out text, sample prompts
  default_corpus.py  the default corpus: fixed, versioned files in examples/data/
  tokenizer.py       BPE training, the cache, token streams
  bandit.py          phases and the EXP3 weights
  pipeline.py        batch sampling on a thread, the device batches a step ahead
"""
