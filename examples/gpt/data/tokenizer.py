"""A byte-level BPE tokenizer trained on the corpus, cached on disk, and the token streams.

The tokenizer (HF `tokenizers`, ANDREA's vocabulary size 8449 by default) is trained
once per corpus: the cache file is keyed by a hash of the corpus text and the vocabulary
size, so a changed source or size trains a new one and an unchanged one is reused. The
token streams (each source's documents joined by the end-of-text token) are cached
beside it under the same key.
"""

import hashlib
import os

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ..training import status

END_OF_TEXT = "<|endoftext|>"
_FORMAT_VERSION = "1"  # bump when the training recipe below changes


def default_cache_dir() -> str:
  root = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
  return os.path.join(os.path.expanduser(root), "clipjax")


def corpus_key(corpus: dict[str, list[str]], vocab_size: int) -> str:
  """A short hash of everything the tokenizer and the token streams depend on."""
  h = hashlib.sha256(f"bpe-v{_FORMAT_VERSION}-vocab{vocab_size}".encode())
  for name, docs in corpus.items():
    h.update(f"\0source\0{name}\0{len(docs)}".encode())
    for doc in docs:
      h.update(len(doc).to_bytes(8, "little"))
      h.update(doc.encode("utf-8"))
  return h.hexdigest()[:16]


def train_tokenizer(corpus: dict[str, list[str]], vocab_size: int) -> Tokenizer:
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size,
      min_frequency=2,
      special_tokens=[END_OF_TEXT],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False)
  docs = [doc for name in corpus for doc in corpus[name]]
  tokenizer.train_from_iterator(docs, trainer=trainer, length=len(docs))
  return tokenizer


def load_tokenizer_and_streams(
    corpus: dict[str, list[str]], vocab_size: int, cache_dir: str
) -> tuple[Tokenizer, dict[str, np.ndarray], str]:
  """The cached tokenizer and token streams for this corpus (made on first use), and
  the corpus key they are cached under."""
  key = corpus_key(corpus, vocab_size)
  os.makedirs(cache_dir, exist_ok=True)
  tokenizer_path = os.path.join(cache_dir, f"tokenizer-{key}.json")
  streams_path = os.path.join(cache_dir, f"tokens-{key}.npz")
  if os.path.exists(tokenizer_path):
    tokenizer = Tokenizer.from_file(tokenizer_path)
  else:
    megabytes = sum(len(doc) for docs in corpus.values() for doc in docs) / 2**20
    with status.timed(f"training the BPE tokenizer (vocabulary {vocab_size}) on "
                      f"{megabytes:.1f} MB of text"):
      tokenizer = train_tokenizer(corpus, vocab_size)
    _atomic_write(tokenizer_path, lambda path: tokenizer.save(path))
  if os.path.exists(streams_path):
    with np.load(streams_path) as npz:
      streams = {name: npz[name] for name in corpus}
  else:
    with status.timed("tokenizing the sources"):
      streams = {name: tokenize_docs(tokenizer, docs) for name, docs in corpus.items()}
    _atomic_write(streams_path, lambda path: np.savez(path, **streams))
  return tokenizer, streams, key


def tokenize_docs(tokenizer: Tokenizer, docs: list[str]) -> np.ndarray:
  """One int32 stream: every document followed by the end-of-text token."""
  eot = tokenizer.token_to_id(END_OF_TEXT)
  ids = []
  for encoding in tokenizer.encode_batch(docs, add_special_tokens=False):
    ids.extend(encoding.ids)
    ids.append(eot)
  return np.asarray(ids, dtype=np.int32)


def _atomic_write(path: str, write) -> None:
  """Writes through a temporary name so a crash never leaves half a cache file."""
  stem, ext = os.path.splitext(path)
  tmp_path = f"{stem}.tmp{os.getpid()}{ext}"
  write(tmp_path)
  os.replace(tmp_path, path)
