"""Structured outputs: a request's grammar (JSON schema, regex, choice, EBNF/Lark) constrains its tokens.

One room, imports one way (``lbd.engine.core`` uses it, it never imports the core):

- ``backends``: one interface (``Backend``, ``Matcher``) over the two libraries, picked by
  ``--structured-outputs-config.backend``: ``xgrammar_backend`` (the default) and ``guidance_backend``
  (llguidance); each imported only when chosen, at the first constrained request (``compiler.load_backend``).
- ``compiler``: compiles grammars on a thread, off the core's step loop, and caches them by the request's
  ``StructuredOutputs`` (the key); a request's ``GrammarState`` waits there, then holds its matcher.
- ``mask``: each step's token bitmask of the constrained sampling rows (filled by the matchers in the core)
  and its application to the logits in the sampler (xgrammar's kernel), in one process or across the TP/PP
  executor's wire.
"""
