"""Inference engines behind one interface (`base.Engine`): the in-process torch engine now, SGLang later.

Import the interface from `actors.generator.engines.base`; an engine module is imported by whoever chooses
it, so heavy optional dependencies stay out of processes that do not use them.
"""
