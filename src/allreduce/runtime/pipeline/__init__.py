"""The one path every collective takes: its stages, the descriptor ranks agree on, the runs it caches, buffers seen
as 1-D numpy, the ordered executor and Work handles, and which thread may call."""
