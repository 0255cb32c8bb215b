"""What a consumer of the wire contract needs, built on ``wire/`` and ``jetstream/`` alone:
reading snapshots and where `CDC` takes over (``snapshots``), claim checks
(``claim_checks``), asking for snapshots (``requests``) and reading table schemas
(``schemas``). The mirror stands on this layer and never on the producer's code
(``test_layers.py`` reads the imports), so what it relies on is what README's contract says.
"""
