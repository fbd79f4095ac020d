"""The parallelism floor: device meshes (`meshes`), logical axis rules and sharding
(`sharding`), multi-host start-up (`distributed`)."""
