"""Training data: the byte-level corpus, tokenizers, `shardlab data prepare`'s tokenized
shards, documents packed into rows, and the resumable, sharded, prefetched feed a run reads."""
