"""Between ranks: point-to-point transfers (``p2p``), agreement on per-step values
(``agreement``) and failures that reach every rank (``failures``)."""
