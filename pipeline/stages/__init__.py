"""The graph's node kinds: infer, track, zones and publish; ``registry`` knows them all."""
