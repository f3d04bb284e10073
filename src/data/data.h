// The data layer: byte tokenizer, llm.c token shards, datasets on disk, the data loader and the
// blended loader.
#pragma once

#include "data/blend.h"
#include "data/dataset.h"
#include "data/documents.h"
#include "data/loader.h"
#include "data/shard.h"
#include "data/tokenizer.h"
