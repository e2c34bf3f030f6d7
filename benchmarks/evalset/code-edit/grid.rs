//! A rectangular grid of cells for Conway's Game of Life.

use std::fmt;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Grid {
    width: usize,
    height: usize,
    cells: Vec<bool>,
}

impl Grid {
    pub fn new(width: usize, height: usize) -> Self {
        Grid { width, height, cells: vec![false; width * height] }
    }

    pub fn from_rows(rows: &[&str]) -> Self {
        let height = rows.len();
        let width = rows.first().map_or(0, |r| r.len());
        let mut grid = Grid::new(width, height);
        for (y, row) in rows.iter().enumerate() {
            for (x, ch) in row.chars().enumerate() {
                grid.set(x, y, ch == '#');
            }
        }
        grid
    }

    fn index(&self, x: usize, y: usize) -> usize {
        y * self.width + x
    }

    pub fn get(&self, x: usize, y: usize) -> bool {
        self.cells[self.index(x, y)]
    }

    pub fn set(&mut self, x: usize, y: usize, alive: bool) {
        let i = self.index(x, y);
        self.cells[i] = alive;
    }

    /// Live neighbours of (x, y); the grid wraps around at its edges.
    pub fn neighbours(&self, x: usize, y: usize) -> usize {
        let mut n = 0;
        for dy in [self.height - 1, 0, 1] {
            for dx in [self.width - 1, 0, 1] {
                if dx == 0 && dy == 0 {
                    continue;
                }
                let nx = (x + dx) % self.width;
                let ny = (y + dy) % self.height;
                if self.get(nx, ny) {
                    n += 1;
                }
            }
        }
        n
    }

    pub fn step(&self) -> Grid {
        let mut next = Grid::new(self.width, self.height);
        for y in 0..self.height {
            for x in 0..self.width {
                let alive = self.get(x, y);
                let n = self.neighbours(x, y);
                next.set(x, y, matches!((alive, n), (true, 2) | (true, 3) | (false, 3)));
            }
        }
        next
    }

    pub fn population(&self) -> usize {
        self.cells.iter().filter(|&&c| c).count()
    }
}

impl fmt::Display for Grid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for y in 0..self.height {
            let row: String = (0..self.width)
                .map(|x| if self.get(x, y) { '#' } else { '.' })
                .collect();
            writeln!(f, "{}", row)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blinker_oscillates() {
        let grid = Grid::from_rows(&[".....", "..#..", "..#..", "..#..", "....."]);
        let next = grid.step();
        assert_eq!(next, Grid::from_rows(&[".....", ".....", ".###.", ".....", "....."]));
        assert_eq!(next.step(), grid);
        assert_eq!(grid.population(), 3);
    }
}
