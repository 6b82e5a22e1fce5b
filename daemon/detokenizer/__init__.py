"""Detokenization, in one place: `incremental` turns a request's token ids into text
deltas (correct across multi-byte characters and SentencePiece spaces);
`output_processor` applies it per step to every request, with stop strings, logprobs
and the `n` samples of one request gathered under its id. The daemon's detokenizer
actor (actors/detokenizer_actor.py) runs an OutputProcessor on the event loop; the
offline engine calls one directly. No torch."""
