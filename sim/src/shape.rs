//! How an answer is laid out on the wire, for testing the meters in front of the simulator:
//! reasoning before the answer (as vLLM's reasoning parsers stream it: chat's
//! `reasoning_content`, a Responses `reasoning` item, a Messages `thinking` block), several
//! tokens per chunk (as engines that batch detokenized output do), or no usage at all (as
//! engines that ignore `stream_options` do).

/// Wire-shape flags; the defaults are vLLM's: one token per chunk, no reasoning, usage on request.
#[derive(Clone, Debug, clap::Args)]
pub struct ShapeFlags {
    /// Generate the first N tokens of a chat, Responses or Messages answer as reasoning
    /// (`reasoning_content`, a `reasoning` item, a `thinking` block), not as its text.
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub reasoning_tokens: u32,
    /// Tokens per stream chunk.
    #[arg(long, default_value_t = 1, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub tokens_per_chunk: u32,
    /// Never report usage: no usage chunk in streams, no `usage` in bodies or events
    /// (`response.usage` is null, Messages carry no usage objects).
    #[arg(long)]
    pub omit_usage: bool,
}

impl Default for ShapeFlags {
    fn default() -> Self {
        ShapeFlags {
            reasoning_tokens: 0,
            tokens_per_chunk: 1,
            omit_usage: false,
        }
    }
}

/// Which field a generated token goes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Field {
    Reasoning,
    Content,
}

impl ShapeFlags {
    pub fn field(&self, index: u32) -> Field {
        if index < self.reasoning_tokens {
            Field::Reasoning
        } else {
            Field::Content
        }
    }

    /// Whether the chunk being built ends after token `index` of `len`.
    pub fn chunk_ends(&self, index: u32, len: u32, pending: u32) -> bool {
        index + 1 == len
            || pending >= self.tokens_per_chunk
            || self.field(index) != self.field(index + 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_end_at_the_size_the_field_change_and_the_last_token() {
        let shape = ShapeFlags {
            reasoning_tokens: 2,
            tokens_per_chunk: 3,
            omit_usage: false,
        };
        let ends: Vec<u32> = {
            let mut pending = 0;
            (0..7)
                .filter(|&i| {
                    pending += 1;
                    let end = shape.chunk_ends(i, 7, pending);
                    if end {
                        pending = 0;
                    }
                    end
                })
                .collect()
        };
        assert_eq!(ends, vec![1, 4, 6]);
        assert_eq!(shape.field(1), Field::Reasoning);
        assert_eq!(shape.field(2), Field::Content);
    }
}
