"""Conversation data as every stage reads it, below them all (regenerate, the dump, eval import it; it imports no
stage).

* formats.py: reading data files (.jsonl/.json/.parquet, ``datasets`` directories, cached hub ids) and normalising
  ShareGPT / OpenAI ``messages`` records; DataError, the data's sha256 and the --data checks;
* masking.py: rendering with the tokenizer's chat template and the loss mask on the assistant's tokens (generation
  blocks or prefix rendering, the end-of-turn ids), and load_samples, which reads, tokenizes and masks.
"""
