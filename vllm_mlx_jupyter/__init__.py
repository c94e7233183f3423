"""IPython/Jupyter front end for vllm_mlx (``%load_ext vllm_mlx_jupyter``).

The ``%%generate`` magics and the cache-inspector widget land with the notebook issue; until
then the package only reserves its name in the distribution.
"""
