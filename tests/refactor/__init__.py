"""Refactorings of vLLM's code generated from the real releases, and the confusion matrix of the verdicts.

    source      a function or class of a file rewritten on its own with libcst, put back, checked
    transforms  rewrites that keep the behaviour (rename, extract, inline, move to a mixin, super(), spellings)
    injections  rewrites that inject a patch's defect (the issue's table of constructs and conditions)
    generator   sites from the engine's own look-ups, variants drawn by Hypothesis, judged in memory, the matrix
    test_transforms  each transform on a snippet, before and after written out
    test_matrix      the CI sample: a fixed, seeded draw over every recorded release, the matrix and its targets

bench/refactorings.py runs the full generation from the command line.
"""
