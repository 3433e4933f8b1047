"""Wire formats that both ends of a weight update share.

The weight push (``weight_sync``, the client) and the inference side (the
client pool and the built-in server, ``inference``) speak the same SGLang and
vLLM control planes. What both need, route paths, request bodies, strict
reply parsers and the built-in server's markers, lives here, below both, so
that ``weight_sync`` never imports ``inference`` (and the reverse arrows stay
the only ones).

* ``errors``: ``MalformedResponse`` and ``need``, what a strict parser raises.
* ``sglang``: SGLang's weight-update bodies (``/init_weights_update_group``,
  ``/update_weights_from_distributed``).
* ``vllm``: vLLM 0.33's weight-transfer routes, bodies and parsers.
* ``builtin``: what the built-in server says about itself in ``/model_info``
  and the extensions a pusher may then use (``?ack=posted``).
"""
