"""Built-in demo target model: corpus, tokenizer and from-scratch pretraining."""
