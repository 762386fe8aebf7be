from fe_megatron.data.sources import DataError
