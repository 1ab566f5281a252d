"""Built-in corpora, readers for data files, and length-bucketed batching (nothing above attnlab.nn)."""
from attnlab.data.batching import collate, pair_lengths, plan_batches, shard_batches
from attnlab.data.files import DataFormatError, PairReader, read_parallel, read_tsv
from attnlab.data.numbers import Splits, german_number, english_number, number_corpus
from attnlab.data.text import TextCorpus, encode_documents, read_text_file, stdlib_corpus, text_file_corpus

__all__ = ["DataFormatError", "PairReader", "Splits", "TextCorpus", "collate", "encode_documents",
           "english_number", "german_number", "number_corpus", "pair_lengths", "plan_batches", "read_parallel",
           "read_text_file", "read_tsv", "shard_batches", "stdlib_corpus", "text_file_corpus"]
