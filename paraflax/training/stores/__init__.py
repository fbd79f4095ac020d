"""Stores: training data made by a model. The tensorstore-backed store (`store`), Jacobi
trajectories (`trajectories`), greedy teacher answers (`teacher`), the rows each process writes
on a mesh (`shares`), and the collect commands that fill them (`collect`)."""
