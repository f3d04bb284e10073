// The data layer: byte tokenizer, llm.c token shards, datasets on disk, and the data loader.
#pragma once

#include "data/dataset.h"
#include "data/loader.h"
#include "data/shard.h"
#include "data/tokenizer.h"
