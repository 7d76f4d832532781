"""The figures of a model on held-out text, shared by `qkv eval` and the training summary; nothing here
imports training.

    tokens        validation loss and the sliding-window bits per character of a token stream
    scoring       a language model's figures on a run's held-out split or any text
    runs          `qkv eval`: each objective's figures (lm, mlm, seq2seq, classify), by the run's objective
    transduction  seq2seq: beam-search translations scored by chrF and exact lines, beside the copy baseline
    chrf          chrF (Popović 2015)
    classify      a classifier's accuracy on held-out works, beside the bag-of-words baseline (baselines)
"""
