"""The model floor: the architecture (`config`), run control (`run`), the NNX decoder
(`transformer`), masked attention (`attention`), the KV cache (`cache`), the pure mask
builders (`masks`) and their tile structure (`mask_structure`)."""
