"""Built-in corpora, readers for parallel data files, and length-bucketed batching."""
from attnlab.data.batching import collate, pair_lengths, plan_batches, shard_batches
from attnlab.data.files import DataFormatError, PairReader, read_parallel, read_tsv
from attnlab.data.numbers import Splits, german_number, english_number, number_corpus

__all__ = ["DataFormatError", "PairReader", "Splits", "collate", "english_number", "german_number",
           "number_corpus", "pair_lengths", "plan_batches", "read_parallel", "read_tsv", "shard_batches"]
