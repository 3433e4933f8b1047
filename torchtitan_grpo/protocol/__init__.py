"""Wire formats that both ends of a weight update share.

The weight push (``weight_sync``, the client) and the inference side (the
client pool in ``fleet`` and the built-in server in ``server``) speak the
same SGLang and vLLM control planes. What both need, route paths, request
bodies, strict reply parsers and the built-in server's markers, lives here,
below both, so that ``weight_sync`` never imports ``fleet`` or ``server``.

* ``errors``: ``MalformedResponse`` and ``need``, what a strict parser raises.
* ``sglang``: SGLang's weight-update bodies (``/init_weights_update_group``,
  ``/update_weights_from_distributed``).
* ``vllm``: vLLM 0.33's weight-transfer routes, bodies and parsers.
* ``builtin``: what the built-in server says about itself in ``/model_info``
  and the extensions a pusher may then use (``?ack=posted``), and the
  environment variable that hands a launched server its API key.
* ``route_codec``: routed experts (MoE router replay) on the wire, as SGLang
  and vLLM send them.

May import: none.
"""
